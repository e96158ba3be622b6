#!/usr/bin/env bash
# The short GPU recheck: what the first GPU check found wrong, checked again in about a minute on a machine
# with a CUDA GPU and no network, with the wheels of `make gpu-wheels` carried beside the tree.
#
#   bash benchmarks/gpu/recheck.sh OUT [WHEELS]
#
# Three steps, each under a time limit, within RECHECK_BUDGET seconds (default 65; RECHECK_TESTS_LIMIT and
# RECHECK_CASE_LIMIT move the limits of the tests and of each benchmark case, 30 and 12 s by default):
#   install  nothing is installed: the wheels are unpacked into a folder on PYTHONPATH (no pip, no
#            resolver, no project wheel to build), the tree's own sources before them, with a generated
#            dist-info for modelload's entry points (the CLI's subcommands). Skipped when this Python
#            already imports what modelload needs (a development virtualenv).
#   tests    the GPU tests of the copy (tests/loader/test_device_copy.py: the refused registration that
#            left an error for the next kernel, the ring tensor across the ring's end pinned each way, a
#            ring smaller than the model streamed while an engine loads), state_dict to the GPU marking
#            each tensor consumed, a hugetlbfs segment pinned whole (where this machine lets the tests
#            mount one), and the keeper consuming as it copies; each test under 20 s.
#   bench    benchmarks/gpu_copy.py on a RECHECK_SIZE GiB model (default 1): the ceilings, full in-place
#            (the mapping pinned once: pinning and copy apart) and staging, the ring in-place, staging and
#            streamed, and in-place pinning each tensor, each case under 12 s by default, one round.
# OUT gets summary.jsonl, install.log, tests.log, tests.xml, bench.log and gpu_copy.jsonl. Without a CUDA
# device the tests skip and the benchmark runs dry, so this runs anywhere (the test suite runs it so).
set -u

# shellcheck source=benchmarks/gpu/steps.sh
. "$(dirname "$0")/steps.sh"  # OUT, WHEELS, PY, ROOT (the working directory), START, record, run_step
BUDGET=${RECHECK_BUDGET:-65}
SIZE=${RECHECK_SIZE:-1}
STEP_MIN_LEFT=8 STEP_RESERVE=3
LIB=$(mktemp -d "${TMPDIR:-/tmp}/modelload-recheck-XXXXXX")
trap 'rm -rf "$LIB"' EXIT
export PY WHEELS LIB ROOT

unpack() { # the wheels into LIB, and a dist-info for the tree's modelload; nothing when already importable
    if [ "${RECHECK_UNPACK:-auto}" = auto ] &&
        "$PY" -c 'import modelload.loader, modelload.sidecar.api, zmq, nacl, fastapi, uvicorn, isal' 2>/dev/null; then
        echo "this Python imports modelload and what it needs: nothing to unpack"
        return 0
    fi
    "$PY" - <<'PYTHON' || return 3
import json, os, sys, time, tomllib, zipfile
from pathlib import Path

started = time.perf_counter()
wheels, lib, root = Path(os.environ["WHEELS"]), Path(os.environ["LIB"]), Path(os.environ["ROOT"])
manifest = wheels / "wheels.json"
if not manifest.is_file():
    sys.exit(f"no wheels at {wheels}: run 'make gpu-wheels GPU_PYTHON=X.Y' where the package index is "
             "reachable, and carry the folder with the tree (the device tool: carry .gpu-wheels)")
want, have = json.loads(manifest.read_text())["python"], "%d.%d" % sys.version_info[:2]
if want != have:
    sys.exit(f"the wheels are for Python {want}, this machine's is {have}: make gpu-wheels GPU_PYTHON={have}")
skip = ("modelload-", "transformers-")  # the tree is the project; transformers is the image's
unpacked = [w for w in sorted(wheels.glob("*.whl")) if not w.name.startswith(skip)]
for wheel in unpacked:
    with zipfile.ZipFile(wheel) as z:
        z.extractall(lib)
project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
info = lib / "modelload-0+tree.dist-info"
info.mkdir()
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: modelload\nVersion: {project['version']}\n")
groups = project.get("entry-points", {})
(info / "entry_points.txt").write_text(
    "".join(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in e.items()) + "\n" for g, e in groups.items())
)
print(f"unpacked {len(unpacked)} wheels into {lib} in {time.perf_counter() - started:.1f} s")
PYTHON
    "$PY" -c 'import modelload.loader, modelload.sidecar.api, zmq, nacl
from modelload.loader.cli.main import build_parser
build_parser("sidecar")  # the entry points of the generated dist-info
print("importable: modelload from", modelload.loader.__file__)'
}

export PYTHONPATH="$ROOT/loader:$ROOT/sidecar:$ROOT/operator:$LIB${PYTHONPATH:+:$PYTHONPATH}"
export -f unpack
echo "GPU recheck of modelload into $OUT, ${BUDGET} s in all"

if run_step install 15 bash -c unpack; then
    run_step tests "${RECHECK_TESTS_LIMIT:-30}" "$PY" -m pytest -m gpu -p no:cacheprovider -q -rs --timeout 20 \
        --junitxml="$OUT/tests.xml" tests/loader/test_device_copy.py tests/loader/test_consuming.py \
        tests/loader/test_attach.py tests/loader/test_huge_page_pins.py \
        "tests/handoff/test_cuda_handoff.py::test_the_keeper_consumes_what_it_copied_in_memory_mode_release"
    mapfile -t dry < <(bench_dry)
    left=$((BUDGET - ($(date +%s) - START) - STEP_RESERVE))
    run_step bench "$left" "$PY" benchmarks/gpu_copy.py --size "$SIZE" --rounds 1 \
        --cases ceiling,full,ring,pinning --budget $((left - 4)) --case-limit "${RECHECK_CASE_LIMIT:-12}" \
        --out "$OUT/gpu_copy.jsonl" "${dry[@]}"
else
    record tests skipped 0 0 "the install failed: see install.log"
    record bench skipped 0 0 "the install failed: see install.log"
fi

finish 8 24
