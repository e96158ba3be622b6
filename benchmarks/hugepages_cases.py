"""The huge-pages section of ``run.py``: the volumes a segment can be on, and the sidecar's cases on each.

Kept apart from ``run.py`` so that the section reads in one place: which volumes (mounted for the run, as a
kubelet mounts them: a tmpfs of 4 KiB pages for ``medium: Memory``, a tmpfs mounted ``huge=always``, and
hugetlbfs with ``pagesize=2M`` for ``medium: HugePages-2Mi``), and which landing paths are compared on each:
the one the sidecar chooses (``auto``) and the other where the volume takes it, so the table shows the
choice was the cheaper one. curl into a 4 KiB tmpfs is the floor, as in the main table; on hugetlbfs, where
curl cannot write, the floor is ``contenders.py mapping`` (bare ranged GETs received straight into a mapping,
no checks): the sidecar's own work on huge pages is its distance from that one.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
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


@contextlib.contextmanager
def huge_page_volumes(work: Path, size: int) -> Iterator[tuple[dict[str, Path], dict[str, str]]]:
    """Each volume mounted with room for a ``size``-byte model's segment, its pages used once before the first
    round (``warm``: a node's pool has served loads before): (folders, skipped with reasons)."""
    room = -(-(size + (64 << 20)) // HUGE_PAGE) * HUGE_PAGE
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


def huge_page_cases(url: str, size: int, volumes: dict[str, Path], *, readers: int) -> list[dict[str, Any]]:
    """The cases of the section as ``run.Case`` fields: the sidecar on each volume, each path, and curl."""
    cases: list[dict[str, Any]] = []
    for kind, folder in volumes.items():
        for landing in ("auto", OTHER.get(kind)):
            if landing is None:
                continue
            argv = ["--source", url, "--segment", str(folder / "model.seg"), "--landing", landing]
            cases.append(
                {"contender": "sidecar", "label": f"{kind} {landing}", "argv": argv, "readers": readers}
            )
    if "hugetlbfs" in volumes:
        argv = ["--source", url, "--size", str(size), "--segment", str(volumes["hugetlbfs"] / "floor.seg")]
        cases.append(
            {"contender": "mapping", "label": "mapping -> hugetlbfs", "argv": argv, "readers": readers}
        )
    cases.append({"contender": "curl", "label": "curl -> tmpfs", "argv": ["--source", url, "--size", str(size)],
                  "readers": readers})  # fmt: skip
    return cases
