"""The huge-pages section of ``make bench``: its table and goals, publishing it alone, and a small real run.

The small run mounts the volumes (root; under ``make test`` a machine that cannot fails) and drives the real
sidecar from nginx onto each, so a change that breaks the section shows here rather than in a bench run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import require

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import report  # noqa: E402
import run  # noqa: E402
from hugepages_cases import round_order  # noqa: E402


def _huge(label: str, number: int, cpu: float, contender: str = "sidecar") -> dict[str, Any]:
    return {"section": "hugepages", "origin": "http", "label": label, "contender": contender, "round": number,
            "gib_s": 1.0, "cpu_s_per_gib": cpu, "peak_rss": 64 << 20, "size": 1 << 30,
            "origin_cpu_s_per_gib": 0.25 + number}  # fmt: skip


def test_the_huge_page_table_compares_cpu_with_4k_pages_within_rounds_and_checks_the_goals() -> None:
    # Round 1 was a slow minute for everyone: within each round hugetlbfs costs 0.4x the 4 KiB-page load.
    records = [
        {"section_meta": "hugepages", "date": "2026-11-26 12:00 UTC", "load_avg": 0.5, "runs": 2},
        _huge("tmpfs auto", 0, 1.0), _huge("tmpfs auto", 1, 2.0),
        _huge("tmpfs mapping", 0, 1.5), _huge("tmpfs mapping", 1, 3.0),
        _huge("hugetlbfs auto", 0, 0.4), _huge("hugetlbfs auto", 1, 0.8),
        _huge("curl -> tmpfs", 0, 1.0, "curl"), _huge("curl -> tmpfs", 1, 2.0, "curl"),
        _huge("mapping -> hugetlbfs", 0, 0.2, "mapping"), _huge("mapping -> hugetlbfs", 1, 0.4, "mapping"),
        {"section": "hugepages", "origin": "http", "volume": "tmpfs-huge", "skipped": "mount refused"},
    ]  # fmt: skip
    table = report.huge_pages_table(records)
    assert (
        "| hugetlbfs, 2 MiB pages (`medium: HugePages-2Mi`) | **mapping** (auto) | **1.00** | 0.60 | 0.40x |"
        in table
    )
    assert "| 4 KiB pages (tmpfs, `medium: Memory`) | mapping (forced) | 1.00 | 2.25 | 1.50x |" in table
    assert "tmpfs mounted `huge=always` | — | not measured: mount refused" in table
    assert "| bare ranged GETs into the mapping (floor) | 1.00 | 0.30 | | | | 0.75 |" in table
    assert table.count("| 64 MiB + segment | 0.75 |") == 3, "nginx's CPU over the same loads, by median"
    goals = report.huge_pages_goals(records)
    assert goals == [
        "- HTTP onto hugetlbfs, 2 MiB pages (`medium: HugePages-2Mi`): 0.60 CPU-s per GiB (not reached; goal "
        "<= 0.35), 0.40x the 4 KiB-page load's (reached; goal <= 0.5); the bare mapping floor 0.30 CPU-s per "
        "GiB (sidecar 2.00x)"
    ]
    assert "load average 0.5" in report.huge_pages_caption(records)


@pytest.mark.parametrize("count", [2, 3, 7])
def test_every_two_rounds_each_pair_of_huge_page_cases_runs_in_both_orders(count: int) -> None:
    for pair in range(3):
        first, second = round_order(count, 2 * pair), round_order(count, 2 * pair + 1)
        assert sorted(first) == sorted(second) == list(range(count))
        for a in range(count):
            for b in range(a + 1, count):
                assert (first.index(a) < first.index(b)) != (second.index(a) < second.index(b)), (a, b)
    assert len({round_order(count, 2 * pair)[0] for pair in range(count)}) == count, "who goes first moves on"


def test_publishing_one_section_keeps_the_published_records_of_the_others(tmp_path: Path) -> None:
    published = tmp_path / "bench-results.jsonl"
    old = [
        {"meta": True, "date": "old"},
        {"section": "table", "label": "sidecar"},
        {"section": "hugepages", "label": "stale"},
        {"section_meta": "hugepages", "date": "old"},
    ]
    published.write_text("".join(json.dumps(r) + "\n" for r in old))
    out = tmp_path / "new.jsonl"
    new = [{"meta": True, "date": "new"}, {"section_meta": "hugepages", "date": "new"},
           {"section": "hugepages", "label": "fresh"}]  # fmt: skip
    out.write_text("".join(json.dumps(r) + "\n" for r in new))
    run.publish(out, {"hugepages"}, published)
    merged = [json.loads(line) for line in published.read_text().splitlines()]
    assert merged == [old[0], old[1], new[1], new[2]], "the main table and its meta stay, the section is new"


@pytest.mark.slow
def test_the_huge_page_section_runs_the_sidecar_onto_each_volume(tmp_path: Path) -> None:
    require(os.geteuid() == 0, "the huge-pages benchmark mounts hugetlbfs and tmpfs (root)")
    out = tmp_path / "results.jsonl"
    argv = [sys.executable, "benchmarks/run.py", "--sections", "hugepages", "--runs", "1", "--size", "0.05",
            "--out", str(out)]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    skipped = [r for r in records if "skipped" in r]
    require(not skipped, f"a volume could not be mounted: {skipped}")
    measured = {r["label"]: r for r in records if r.get("section") == "hugepages" and "label" in r}
    assert set(measured) == {"tmpfs auto", "tmpfs mapping", "tmpfs-huge auto", "tmpfs-huge splice",
                             "hugetlbfs auto", "mapping -> hugetlbfs", "curl -> tmpfs"}  # fmt: skip
    failed = {label: r["error"] for label, r in measured.items() if "error" in r}
    assert not failed, failed
    assert all(r["nbytes"] > 0 and r["cpu_s_per_gib"] > 0 for r in measured.values())
    assert all(r["origin_cpu_s"] >= 0 and "position" in r for r in measured.values()), "nginx's CPU beside"
