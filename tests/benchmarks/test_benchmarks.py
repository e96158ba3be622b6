"""The benchmark's parts that must stay right between runs of ``make bench``: the cluster Jobs render and
validate and carry the current measuring script, that script runs on the standard library alone (it is
mounted into images that lack modelload), and the report's ratios are taken within rounds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import cluster  # noqa: E402
import report  # noqa: E402

VERSIONS = ["1.29", "1.31", "1.33"]


def docs() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(cluster.MANIFEST.read_text()) if d]


def test_the_manifest_on_disk_is_the_rendered_one() -> None:
    assert cluster.MANIFEST.read_text() == cluster.render(), "run python benchmarks/cluster.py --write"


@pytest.mark.parametrize("version", VERSIONS)
def test_every_object_validates_against_kubernetes(version: str) -> None:
    for doc in docs():
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_jobs_mount_the_current_contenders_script_and_the_settings_they_read() -> None:
    by_name = {(d["kind"], d["metadata"]["name"]): d for d in docs()}
    contenders = by_name[("ConfigMap", "modelload-benchmark-contenders")]
    assert contenders["data"]["contenders.py"] == (ROOT / "benchmarks" / "contenders.py").read_text()
    settings = by_name[("ConfigMap", "modelload-benchmark-settings")]["data"]
    jobs = {name: d for (kind, name), d in by_name.items() if kind == "Job"}
    assert set(jobs) == {f"modelload-benchmark-{c}" for c in ("sidecar", "tensorizer", "runai")}
    for name, job in jobs.items():
        contender = name.rsplit("-", 1)[1]
        pod = job["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        command = container["command"][-1]
        assert f"python /bench/contenders.py {contender} " in command
        for variable in ("READERS", "CHUNK_BYTES", "S3_ENDPOINT", cluster.SOURCE[contender]):
            assert f"${variable}" in command or f"${{{variable}" in command
            assert variable in settings
        assert {v["name"] for v in pod["volumes"]} >= {"contenders"}
        assert job["metadata"]["namespace"] == cluster.NAMESPACE


def test_the_measuring_script_needs_only_the_standard_library() -> None:
    # -I -S: no site-packages, no PYTHONPATH: what a bare python image has.
    done = subprocess.run(
        [sys.executable, "-I", "-S", str(ROOT / "benchmarks" / "contenders.py"), "curl", "--source", "x",
         "--readers", "0"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "--readers must be at least 1" in done.stderr


def _round(label: str, contender: str, number: int, gib_s: float) -> dict[str, Any]:
    return {"section": "table", "origin": "http", "label": label, "contender": contender, "round": number,
            "gib_s": gib_s, "cpu_s_per_gib": 1.0, "peak_rss": 1 << 20}  # fmt: skip


def test_ratios_are_taken_within_rounds_and_tensorizer_shows_its_best_variant() -> None:
    # Round 1 ran on a slow minute for everyone: the ratio within each round is 2.0, while the ratio of the
    # medians (2.0 / 1.5) would not be.
    records = [
        _round("sidecar", "sidecar", 0, 4.0), _round("sidecar", "sidecar", 1, 1.0),
        _round("sidecar", "sidecar", 2, 2.0),
        _round("tensorizer 4r", "tensorizer", 0, 2.0), _round("tensorizer 4r", "tensorizer", 1, 0.5),
        _round("tensorizer 4r", "tensorizer", 2, 1.0),
        _round("tensorizer 1r", "tensorizer", 0, 0.1), _round("tensorizer 1r", "tensorizer", 1, 0.1),
        _round("tensorizer 1r", "tensorizer", 2, 0.1),
        {"section": "table", "origin": "http", "label": "runai", "contender": "runai",
         "skipped": "no HTTP(S) source"},
    ]  # fmt: skip
    cases = report.group(records, "table")[("http", None)]
    assert cases["tensorizer"].label == "tensorizer 4r"
    assert report.ratio(cases["sidecar"], cases["tensorizer"]) == pytest.approx(2.0)
    table = report.main_table(records)
    assert "| tensorizer (num_readers 4) | 1.00 | 2.00x |" in table
    assert "Run:ai Model Streamer | — (no HTTP(S) source)" in table


def _memory_modes(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "benchmarks/memory_modes.py", "--runs", "1", *args]
    return subprocess.run(argv, check=False, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


@pytest.mark.slow
def test_the_memory_modes_benchmark_runs_each_mode_and_checks_its_goals() -> None:
    # make bench runs it on 2 GiB; a quarter of that proves it still drives the sidecar and the loader as
    # they are (a renamed keyword once broke it with nothing to notice).
    done = _memory_modes("--size", "0.25", "--ring-size", "96MiB", timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    for line in ("ring peak", "release volume after the consumer", "ring throughput / full"):
        assert line in done.stdout, done.stdout


def test_the_memory_modes_benchmark_names_a_refused_load_in_one_line() -> None:
    done = _memory_modes("--size", "0.0625", "--ring-size", "8MiB", timeout=120)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    assert "set --ring-size" in done.stderr
