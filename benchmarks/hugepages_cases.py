"""The huge-pages section of ``run.py``: the volumes a segment can be on, the sidecar's cases on each, and the
rounds that measure them.

Kept apart from ``run.py`` so that the section reads in one place: which volumes (mounted for the run, as a
kubelet mounts them: a tmpfs of 4 KiB pages for ``medium: Memory``, a tmpfs mounted ``huge=always``, and
hugetlbfs with ``pagesize=2M`` for ``medium: HugePages-2Mi``), and which landing paths are compared on each:
the one the sidecar chooses (``auto``) and the other where the volume takes it, so the table shows the
choice was the cheaper one. curl into a 4 KiB tmpfs is the floor, as in the main table; on hugetlbfs, where
curl cannot write, the floor is ``contenders.py mapping`` (bare ranged GETs received straight into a mapping,
no checks): the sidecar's own work on huge pages is its distance from that one.

Two things make the rounds fair (:func:`huge_page_rounds`):

- **no case always goes first.** The first load onto a huge tmpfs in a round cost 2.3-4.1 CPU-s per GiB
  here, the load right after it 0.4-0.9, whichever landing path either took. Each odd round runs the cases
  of the round before in reverse (:func:`round_order`), and each case's volume has its pages taken and
  given back just before the case (:func:`~tests.support.hugepages.warm`, outside the measurement). That
  narrows the gap but does not close it: ``/proc/vmstat`` counts no compaction and no fallback to 4 KiB
  pages in those loads, and this virtual machine reports freed memory to its host (``virtio_balloon``
  free page reporting, blocks of 8 MiB and up), so a page touched again a few seconds after it was freed
  is faulted in by the host first. hugetlbfs keeps its pool and never frees it: its rows do not move.
- **the origin's CPU is recorded beside the sidecar's.** On loopback, the TCP work of receiving (and some
  of sending) runs in whichever process is on the CPU when a packet moves: a receiver that sleeps longer
  leaves more of it to nginx. ``origin_cpu_s`` (nginx's master and workers over the same load) shows
  whether a change saved work or only moved it.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from tests.support.hugepages import HUGE_PAGE, Unavailable, huge_volume, warm  # noqa: E402

VOLUMES = {
    "tmpfs": "4 KiB pages (tmpfs, medium: Memory)",
    "tmpfs-huge": "tmpfs mounted huge=always",
    "hugetlbfs": "hugetlbfs, 2 MiB pages (medium: HugePages-2Mi)",
}
OTHER = {"tmpfs": "mapping", "tmpfs-huge": "splice"}
"""The path the sidecar does not choose on each volume, measured beside its choice (hugetlbfs takes one)."""
MIB, GIB = 1 << 20, 1 << 30
CHUNK = 32 * MIB
"""The range size of every case, as on the main table's loopback origins."""
_ROOM_MARGIN = 64 << 20
"""Room on each volume beyond the model: the segment's own pages (header, table) and a margin."""


@dataclass(frozen=True)
class HugeCase:
    """One case of the section: ``run.Case`` fields, and the volume it lands on (its pages are taken and
    given back just before it runs), or None (curl, into /dev/shm)."""

    fields: dict[str, Any]
    volume: Path | None = None

    @property
    def label(self) -> str:
        return str(self.fields["label"])


@contextlib.contextmanager
def huge_page_volumes(work: Path, size: int) -> Iterator[tuple[dict[str, Path], dict[str, str]]]:
    """Each volume mounted with room for a ``size``-byte model's segment, its pages used once before the first
    round (``warm``: a node's pool has served loads before): (folders, skipped with reasons)."""
    room = _room(size)
    with contextlib.ExitStack() as stack:
        folders: dict[str, Path] = {}
        skipped: dict[str, str] = {}
        for kind in VOLUMES:
            try:
                folders[kind] = stack.enter_context(huge_volume(kind, work / kind, room))
            except Unavailable as exc:
                skipped[kind] = str(exc)
                continue
            warm(folders[kind], room - (32 << 20))
        yield folders, skipped


def _room(size: int) -> int:
    return -(-(size + _ROOM_MARGIN) // HUGE_PAGE) * HUGE_PAGE


def huge_page_cases(url: str, size: int, volumes: dict[str, Path], *, readers: int) -> list[HugeCase]:
    """The cases of the section: the sidecar on each volume, each path, the bare mapping floor, and curl."""
    cases: list[HugeCase] = []
    for kind, folder in volumes.items():
        for landing in ("auto", OTHER.get(kind)):
            if landing is None:
                continue
            argv = ["--source", url, "--segment", str(folder / "model.seg"), "--landing", landing]
            fields = {"contender": "sidecar", "label": f"{kind} {landing}", "argv": argv, "readers": readers,
                      "chunk": CHUNK}  # fmt: skip
            cases.append(HugeCase(fields, folder))
    if "hugetlbfs" in volumes:
        argv = ["--source", url, "--size", str(size), "--segment", str(volumes["hugetlbfs"] / "floor.seg")]
        fields = {"contender": "mapping", "label": "mapping -> hugetlbfs", "argv": argv, "readers": readers,
                  "chunk": CHUNK}  # fmt: skip
        cases.append(HugeCase(fields, volumes["hugetlbfs"]))
    fields = {"contender": "curl", "label": "curl -> tmpfs", "argv": ["--source", url, "--size", str(size)],
              "readers": readers, "chunk": CHUNK}  # fmt: skip
    cases.append(HugeCase(fields))
    return cases


def round_order(count: int, number: int) -> list[int]:
    """The order of ``count`` cases in round ``number``: each odd round is the round before it reversed, so
    every two rounds each pair of cases runs in both orders; each pair of rounds starts one case later."""
    shift = (number // 2) % max(1, count)
    order = list(range(shift, count)) + list(range(shift))
    return order[::-1] if number % 2 else order


def process_tree_cpu(pid: int) -> float:
    """CPU seconds (user + system) used so far by process ``pid`` and its direct children: nginx's master
    and its workers."""
    ticks = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if int(entry.name) == pid or int(fields[1]) == pid:
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def huge_page_rounds(
    cases: list[HugeCase],
    runs: int,
    *,
    measure: Callable[[dict[str, Any]], dict[str, Any]],
    write: Callable[[dict[str, Any]], None],
    origin_pid: int,
    size: int,
) -> None:
    """``runs`` rounds over ``cases`` in :func:`round_order`, each case's volume warmed just before it; one
    record per measurement (``write``), with the origin's CPU over the same load and the case's position."""
    for number in range(runs):
        for position, index in enumerate(round_order(len(cases), number)):
            case = cases[index]
            if case.volume is not None:
                warm(case.volume, _room(size) - (32 << 20))
            origin_before = process_tree_cpu(origin_pid)
            result = measure(case.fields)
            origin_cpu = process_tree_cpu(origin_pid) - origin_before
            record = {"section": "hugepages", "origin": "http", "label": case.label,
                      "contender": case.fields["contender"], "round": number, "position": position,
                      "readers": case.fields["readers"], "chunk": case.fields["chunk"], "size": size,
                      **result}  # fmt: skip
            if "nbytes" in result:
                record["origin_cpu_s"] = origin_cpu
                record["origin_cpu_s_per_gib"] = origin_cpu / (result["nbytes"] / GIB)
            write(record)
            shown = (
                f"{result['gib_s']:6.2f} GiB/s {result['cpu_s_per_gib']:5.2f} CPU-s/GiB "
                f"(nginx {record['origin_cpu_s_per_gib']:4.2f}) {result['peak_rss'] / MIB:6.0f} MiB"
                if "gib_s" in result
                else f"failed: {result['error']}"
            )
            print(f"  [hugepages http r{number}] {case.label:<22} {shown}", flush=True)
