"""The sidecar's C heap: freed big blocks leave the process (``modelload.sidecar.heap``).

Each case runs in a fresh interpreter (the setting is the process's), and reads glibc's own count of blocks
served by a mapping of their own (``mallinfo2().hblks``): no memory figure is asserted.
"""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from modelload.sidecar.heap import tune_heap

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")

# A freed 8 MiB block raises glibc's mapping threshold past 2 MiB: then a 2 MiB block (over the pinned
# threshold) is mapped only when the threshold is pinned. Prints the blocks mapped for it (1 or 0).
PROBE = """
import ctypes, json, sys
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
from modelload.sidecar.heap import tune_heap
tuned = tune_heap(json.loads(sys.argv[1])) if sys.argv[2] == "tune" else None
big = bytearray(8 << 20)
del big
before = libc.mallinfo2().hblks
block = bytearray(2 << 20)
print(json.dumps({"tuned": tuned, "mapped": libc.mallinfo2().hblks - before}))
"""


def probe(environ: dict[str, str], tune: bool) -> dict[str, object]:
    import json

    done = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(environ), "tune" if tune else "leave"],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    result: dict[str, object] = json.loads(done.stdout)
    return result


def test_once_tuned_a_big_block_is_mapped_of_its_own_even_after_a_bigger_one_was_freed() -> None:
    assert probe({}, tune=True) == {"tuned": True, "mapped": 1}


def test_untuned_glibc_serves_it_from_the_heap_which_is_what_the_tuning_prevents() -> None:
    # The probe's premise: without the setting, glibc's raised threshold keeps the block in the heap.
    assert probe({}, tune=False) == {"tuned": None, "mapped": 0}


@pytest.mark.parametrize("variable", ["MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_ARENA_MAX"])
def test_a_heap_tuned_by_the_operators_own_malloc_variable_is_left_as_it_is(variable: str) -> None:
    assert tune_heap({variable: "1048576"}) is False
    assert probe({variable: "1048576"}, tune=True) == {"tuned": False, "mapped": 0}
