"""The goals against the peers (issue 20), checked on ``run.py``'s records: printed at the end of a run and
listed with the other goals in ``docs/benchmarks.md``.

- On a local file with verification on (origin ``file-verify``: the sidecar with ``--verify`` and tensorizer
  with ``verify_hash=True`` reading the same tensorizer file): the sidecar at least 1.1 x tensorizer's speed.
- On s3rver (a real S3 server, one Node thread): at least 1.2 x tensorizer.
- On the S3-like origin over S3, for 1 to 16 readers (the ``readers`` section, and the main table's row): the
  sidecar at least 0.9 of min(link, readers x the per-request cap). curl's share in the same rounds is shown
  beside it: what a raw client reaches against the same origin on this machine.

Every ratio is the median over rounds of the ratio within a round (tensorizer: its best ``num_readers``), each
figure with the median load average its rounds were measured at.
"""

from __future__ import annotations

import statistics
from typing import Any

from origins import LINK_GBIT, RATE_MB_S
from report import Case, group, ratio

GIB = 1 << 30
TENSORIZER_GOALS = {"file-verify": 1.1, "s3rver": 1.2}
TITLES = {"file-verify": "local file, hashes verified", "s3rver": "s3rver"}
SHARE_GOAL = 0.9
MAX_READERS = 16


def link_and_cap() -> tuple[float, float]:
    """The S3-like origin's link and one request's cap, in GiB/s."""
    return LINK_GBIT * 1e9 / 8 / GIB, RATE_MB_S * 1e6 / GIB


def _verdict(value: float, goal: float, *, digits: int = 2) -> str:
    if value != value:  # NaN: nothing to compare
        return "not measured"
    return f"{value:.{digits}f} ({'reached' if value >= goal else 'NOT reached'}, goal >= {goal:g})"


def _load(*cases: Case) -> str:
    loads = [r["load_avg"] for case in cases for r in case.ok if "load_avg" in r]
    return f"load {statistics.median(loads):.1f}" if loads else "load not recorded"


def _share(case: Case, readers: int) -> float:
    """Median over rounds of the case's GiB/s over min(link, readers x cap)."""
    link, cap = link_and_cap()
    bound = min(link, readers * cap)
    values = [r["gib_s"] / bound for r in case.ok]
    return statistics.median(values) if values else float("nan")


def peer_goals(records: list[dict[str, Any]]) -> list[str]:
    """One line per goal against the peers, from whatever of them the records measured."""
    lines = []
    table = group(records, "table")
    for origin, goal in TENSORIZER_GOALS.items():
        cases = table.get((origin, None), {})
        sidecar, tensorizer = cases.get("sidecar"), cases.get("tensorizer")
        if sidecar is None or tensorizer is None or not sidecar.ok or not tensorizer.ok:
            continue
        lines.append(
            f"- {TITLES[origin]}: sidecar / tensorizer ({tensorizer.label}) "
            f"{_verdict(ratio(sidecar, tensorizer), goal)}; {sidecar.gib_s:.2f} against {tensorizer.gib_s:.2f} "
            f"GiB/s, {sidecar.cpu:.2f} against {tensorizer.cpu:.2f} CPU-s/GiB ({_load(sidecar, tensorizer)})"
        )
    points = [(int(x), "readers curve", cases) for (_, x), cases in group(records, "readers").items()]
    row = table.get(("s3like-s3", None), {})
    if "sidecar" in row and row["sidecar"].ok:
        points.append((int(row["sidecar"].ok[0]["readers"]), "main table", row))
    for readers, where, cases in sorted(points, key=lambda point: point[0]):
        sidecar, curl = cases.get("sidecar"), cases.get("curl")
        if readers > MAX_READERS or sidecar is None or not sidecar.ok:
            continue
        beside = f"; curl {_share(curl, readers):.3f}" if curl is not None and curl.ok else ""
        lines.append(
            f"- S3-like origin, {readers} readers ({where}): sidecar / min(link, readers x {RATE_MB_S:g} MB/s) "
            f"{_verdict(_share(sidecar, readers), SHARE_GOAL, digits=3)}{beside} ({_load(sidecar)})"
        )
    return lines
