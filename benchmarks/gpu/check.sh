#!/usr/bin/env bash
# The GPU check: on a machine with a CUDA GPU and no network, install what modelload needs from wheels made
# beforehand (make gpu-wheels), run the CUDA tests (pytest -m gpu) and the GPU benchmark, and leave the
# figures in OUT. Each step has a time limit and one summary line; the whole check keeps to
# GPU_CHECK_BUDGET seconds (default 470: 8 minutes with room to copy the results back).
#
#   bash benchmarks/gpu/check.sh OUT [WHEELS]          # or: make gpu-check OUT=dir
#
# OUT gets at most eight files: summary.jsonl (one line per step), env.json (the machine), and each step's
# log (env.log, install.log, tests.log with tests.xml, bench.log with gpu_copy.jsonl, the figures: those of
# benchmarks/gpu_copy.py, then those of benchmarks/gpu_many_tensors.py).
# Variables: GPU_WHEELS (default .gpu-wheels), GPU_CHECK_PYTHON (default python3), GPU_BENCH_SIZE (GiB,
# default 4), GPU_BENCH_ARGS (more flags for benchmarks/gpu_copy.py), GPU_MANY_BUDGET (seconds kept for
# benchmarks/gpu_many_tensors.py, default 90), GPU_CHECK_BUDGET (seconds),
# MODELLOAD_COMMIT (what the figures are labelled with; default the wheels' commit, or "a tree changed
# since" it when the sources differ from those the wheels were built from). Exit
# status 0 when every step passed.
set -u

# shellcheck source=benchmarks/gpu/steps.sh
. "$(dirname "$0")/steps.sh"  # OUT, WHEELS, PY, ROOT (the working directory), START, record, run_step
BUDGET=${GPU_CHECK_BUDGET:-470}
SIZE=${GPU_BENCH_SIZE:-4}
INSTALLED=0

wheels_field() { # the value of one field of WHEELS/wheels.json, or nothing
    "$PY" -c 'import json, sys; print(json.load(open(sys.argv[1])).get(sys.argv[2], ""))' \
        "$WHEELS/wheels.json" "$1" 2>/dev/null
}

install() { # what the image lacks, from the wheels; the project from this tree when its wheel is stale
    if [ ! -f "$WHEELS/wheels.json" ]; then
        echo "no wheels at $WHEELS: run 'make gpu-wheels GPU_PYTHON=X.Y' where the package index is reachable"
        echo "and carry the folder with the tree (the device tool: carry .gpu-wheels)"
        return 3
    fi
    local want have digest built from site
    want=$(wheels_field python)
    have=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    if [ "$want" != "$have" ]; then
        echo "the wheels are for Python $want, this machine's is $have: make gpu-wheels GPU_PYTHON=$have"
        return 3
    fi
    from=$(mktemp -d)
    cp "$WHEELS"/*.whl "$WHEELS/requirements.txt" "$from/"
    digest=$("$PY" benchmarks/gpu/wheels.py --digest)
    built=$(wheels_field source_digest)
    if [ "$digest" != "$built" ]; then
        echo "the project wheel was built from other sources ($(wheels_field commit)): building one from this tree"
        rm -f "$from"/modelload-*.whl
        "$PY" -m pip wheel --quiet --no-deps --no-build-isolation --no-index --wheel-dir "$from" . || return 4
    fi
    site=()
    "$PY" -c 'import os, sysconfig, sys; sys.exit(not os.access(sysconfig.get_paths()["purelib"], os.W_OK))' ||
        site=(--user)
    "$PY" -m pip install --no-index --no-cache-dir --disable-pip-version-check "${site[@]}" \
        --find-links "$from" -r "$from/requirements.txt" || return 5
    "$PY" -m pip install --no-index --no-cache-dir --disable-pip-version-check "${site[@]}" \
        --no-deps --force-reinstall "$from"/modelload-*.whl || return 6
    "$PY" -c 'import modelload.loader, modelload.sidecar.api, zmq, nacl, pytest_asyncio, transformers, torch
print("installed: modelload from", modelload.loader.__file__, "| torch", torch.__version__,
      "| transformers", transformers.__version__)'
}

gpu_tests() { # every test module that holds gpu-marked tests, the gpu ones only
    local files
    mapfile -t files < <(grep -rlE "pytest\.mark\.gpu" tests --include='test_*.py' | sort)
    "$PY" -m pytest -m gpu -p no:cacheprovider -q -rs --junitxml="$OUT/tests.xml" "${files[@]}"
}

benches() { # BUDGET [--dry]: the copy benchmark, then the tensor-count one into the same figures file
    local rc=0 status
    # shellcheck disable=SC2086  # GPU_BENCH_ARGS is a list of flags
    "$PY" benchmarks/gpu_copy.py --size "$SIZE" --out "$OUT/gpu_copy.jsonl" --budget "$1" "${@:2}" \
        ${GPU_BENCH_ARGS:-} || rc=$?
    echo
    "$PY" benchmarks/gpu_many_tensors.py --out "$OUT/gpu_copy.jsonl" --budget "$((MANY_BUDGET / 2))" \
        "${@:2}" || { status=$?; [ "$rc" = 0 ] && rc=$status; }
    return "$rc"
}

MANY_BUDGET=${GPU_MANY_BUDGET:-90}
export PY WHEELS OUT SIZE MANY_BUDGET
export -f wheels_field install gpu_tests benches
# What the figures were measured on: the caller's word (MODELLOAD_COMMIT), else the wheels' commit when the
# tree is what they were built from; a tree changed since is not that commit (the install builds it afresh).
if [ -z "${MODELLOAD_COMMIT:-}" ]; then
    MODELLOAD_COMMIT=$(wheels_field commit)
    if [ -f "$WHEELS/wheels.json" ] && [ "$("$PY" benchmarks/gpu/wheels.py --digest)" != "$(wheels_field source_digest)" ]; then
        MODELLOAD_COMMIT="a tree changed since ${MODELLOAD_COMMIT:-its wheels}"
    fi
fi
export MODELLOAD_COMMIT=${MODELLOAD_COMMIT:-unknown}
echo "GPU check of modelload (${MODELLOAD_COMMIT}) into $OUT, ${BUDGET} s in all"

run_step env 30 "$PY" benchmarks/gpu/env.py "$OUT/env.json"
if run_step install 150 bash -c install; then INSTALLED=1; fi
if [ "$INSTALLED" = 1 ]; then
    run_step tests 200 bash -c gpu_tests
    bench_limit=$((BUDGET - ($(date +%s) - START) - 10))
    mapfile -t dry < <(bench_dry)
    # The benchmarks keep to their budgets themselves (gpu_copy.py: each case under its own limit, cases
    # its budget has no room for skipped with a line saying so; gpu_many_tensors.py: no round started past
    # half of GPU_MANY_BUDGET, a round taking less than that): the step's limit is only the backstop.
    run_step bench "$bench_limit" bash -c 'benches "$@"' bench "$((bench_limit - 15 - MANY_BUDGET))" "${dry[@]}"
else
    record tests skipped 0 0 "the install failed: see install.log"
    record bench skipped 0 0 "the install failed: see install.log"
fi

finish 12 42
