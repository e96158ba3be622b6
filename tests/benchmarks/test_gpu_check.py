"""What the first GPU run taught the GPU benchmark and the recheck: a ring sized from the model as generated,
a case that hangs cut at its limit with the stacks of every thread and the run going on, and the short
recheck script running through where there is no GPU (its CUDA parts skipped)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from modelload.loader.dtypes import by_name
from modelload.loader.segment import MemoryMode, TensorSpec, plan_layout

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))

import synthetic  # noqa: E402

GiB = 1 << 30


@pytest.mark.parametrize("size", [1, 4, 8])
def test_the_ring_of_the_loaded_first_ring_case_holds_the_model_as_generated(size: int) -> None:
    shapes = synthetic.model_shapes(size * GiB)
    specs = [TensorSpec(name, by_name("bfloat16"), shape) for name, shape in shapes.items()]
    full = plan_layout(specs)
    ring = synthetic.whole_ring(full.data_length)
    layout = plan_layout(specs, memory_mode=MemoryMode.RING, ring_size=ring)
    end = max(s.offset + s.nbytes for s in layout.slots) - layout.data_offset
    assert end <= layout.ring_size, "the last tensor would wait for room that only a consumer frees"
    if size == 4:  # the first GPU run: a ring of the size asked for plus 256 MiB, too small by 8 MiB
        assert size * GiB + (256 << 20) < full.data_length


def _bench(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], list[dict[str, object]]]:
    out = tmp_path / "gpu.jsonl"
    argv = [sys.executable, "benchmarks/gpu_copy.py", "--dry", "--out", str(out), *args]
    done = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=280, cwd=ROOT)
    return done, [json.loads(line) for line in out.read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_case_that_hangs_is_cut_at_its_limit_with_every_thread_s_stack_and_the_run_goes_on(
    tmp_path: Path,
) -> None:
    # The limit is every case's: it must leave the cases that do not hang room to finish on a busy machine
    # (at 5 s, a sidecar's load on a loaded CI runner could be cut too).
    done, records = _bench(
        tmp_path, "--cases", "ceiling,full,ring", "--stall", "ring host #0", "--case-limit", "25"
    )
    assert done.returncode == 1, "a case cut short fails the run"
    assert "Traceback" not in done.stderr
    (cut,) = [r for r in records if r["section"] == "case"]
    assert cut["case"] == "ring host #0" and cut["status"] == "timeout"
    assert "thread MainThread" in str(cut["traceback"]) and "time.sleep" in str(cut["traceback"])
    measured = {(r["section"], r.get("case")) for r in records}
    assert ("copy", "full host") in measured, "the cases before it kept their figures"
    assert ("overlap", "ring streamed") in measured, "the cases after it ran"
    lines = done.stdout.splitlines()
    assert any("ring host #0: TIMEOUT (cut at its limit of 25 s)" in line for line in lines)
    assert any("ring streamed #0: done in" in line for line in lines), "progress is printed as it goes"
    assert "cases not measured: ring host #0 (timeout)" in done.stdout


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_the_gpu_recheck_runs_through_without_a_gpu_and_skips_its_cuda_parts(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # The script's limits fit a GPU machine's minute; here they are widened so that what the test checks
    # (every step runs through, the CUDA parts skipped) does not hang on how busy this machine is.
    limits = {"RECHECK_BUDGET": "300", "RECHECK_TESTS_LIMIT": "150", "RECHECK_CASE_LIMIT": "60"}
    env = os.environ | {"GPU_CHECK_PYTHON": sys.executable, **limits}
    argv = ["bash", "benchmarks/gpu/recheck.sh", str(out), str(tmp_path / "no-wheels")]
    done = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=330, cwd=ROOT, env=env)
    steps = [json.loads(line) for line in (out / "summary.jsonl").read_text().splitlines()]
    statuses = [(s["step"], s["status"]) for s in steps]
    assert statuses == [("install", "ok"), ("tests", "ok"), ("bench", "ok")], done.stdout + done.stderr
    assert "needs a CUDA device" in (out / "tests.log").read_text()
    assert "test_a_refused_registration_falls_back" in (out / "tests.xml").read_text()
    bench = (out / "bench.log").read_text()
    assert "CUDA: skipped (--dry)" in bench and "ring streamed #0: done in" in bench
    records = [json.loads(line) for line in (out / "gpu_copy.jsonl").read_text().splitlines()]
    assert {("copy", "full host"), ("copy", "ring host")} <= {(r["section"], r.get("case")) for r in records}
    assert len(list(out.iterdir())) <= 8  # what the device tool brings back


def test_the_recheck_without_wheels_says_how_to_make_them(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = os.environ | {"GPU_CHECK_PYTHON": sys.executable, "RECHECK_UNPACK": "always"}
    argv = ["bash", "benchmarks/gpu/recheck.sh", str(out), str(tmp_path / "no-wheels")]
    done = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    assert done.returncode == 1
    steps = [json.loads(line) for line in (out / "summary.jsonl").read_text().splitlines()]
    assert [(s["step"], s["status"]) for s in steps] == [
        ("install", "failed"), ("tests", "skipped"), ("bench", "skipped"),
    ]  # fmt: skip
    assert "make gpu-wheels GPU_PYTHON=X.Y" in (out / "install.log").read_text()


def test_the_tensor_count_benchmark_runs_dry_through_the_device_stand_in(tmp_path: Path) -> None:
    out = tmp_path / "many.jsonl"
    argv = [sys.executable, "benchmarks/gpu_many_tensors.py", "--dry", "--out", str(out)]
    done = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    cases = {(r["model"], r["way"]) for r in records if r["section"] == "many tensors"}
    assert cases == {(m, w) for m in ("dense", "moe") for w in ("per tensor", "runs")}
    assert all(r["bitwise"] for r in records if "bitwise" in r)
    assert "every device tensor bitwise equal to the segment" in done.stdout
