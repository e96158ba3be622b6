#!/usr/bin/env bash
# The GPU check: on a machine with a CUDA GPU and no network, install what modelload needs from wheels made
# beforehand (make gpu-wheels), run the CUDA tests (pytest -m gpu) and the GPU benchmark, and leave the
# figures in OUT. Each step has a time limit and one summary line; the whole check keeps to
# GPU_CHECK_BUDGET seconds (default 470: 8 minutes with room to copy the results back).
#
#   bash benchmarks/gpu/check.sh OUT [WHEELS]          # or: make gpu-check OUT=dir
#
# OUT gets at most eight files: summary.jsonl (one line per step), env.json (the machine), and each step's
# log (env.log, install.log, tests.log with tests.xml, bench.log with gpu_copy.jsonl, the figures).
# Variables: GPU_WHEELS (default .gpu-wheels), GPU_CHECK_PYTHON (default python3), GPU_BENCH_SIZE (GiB,
# default 4), GPU_BENCH_ARGS (more flags for benchmarks/gpu_copy.py), GPU_CHECK_BUDGET (seconds). Exit
# status 0 when every step passed.
set -u

OUT=${1:-}
if [ -z "$OUT" ]; then
    echo "usage: $0 OUT [WHEELS]  (OUT: a folder for the figures and logs)" >&2
    exit 2
fi
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT" || exit 2
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
WHEELS=${2:-${GPU_WHEELS:-$ROOT/.gpu-wheels}}
PY=${GPU_CHECK_PYTHON:-python3}
BUDGET=${GPU_CHECK_BUDGET:-470}
SIZE=${GPU_BENCH_SIZE:-4}
START=$(date +%s)
SUMMARY=$OUT/summary.jsonl
: >"$SUMMARY"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
INSTALLED=0
FAILED=0

wheels_field() { # the value of one field of WHEELS/wheels.json, or nothing
    "$PY" -c 'import json, sys; print(json.load(open(sys.argv[1])).get(sys.argv[2], ""))' \
        "$WHEELS/wheels.json" "$1" 2>/dev/null
}

record() { # NAME STATUS EXIT SECONDS NOTE: one JSON line in summary.jsonl, one line on the terminal
    "$PY" -c 'import json, sys
step, status, code, seconds, note = sys.argv[1:]
print(json.dumps({"step": step, "status": status, "exit": int(code), "seconds": int(seconds), "note": note}))' \
        "$@" >>"$SUMMARY"
    printf 'step %-8s %-8s exit %-3s %4s s  %s\n' "$1" "$2" "$3" "$4" "$5"
    [ "$2" = ok ] || FAILED=1
}

run_step() { # NAME LIMIT COMMAND...: run it under a time limit, its output in OUT/NAME.log
    local name=$1 limit=$2 left began rc status seconds
    shift 2
    left=$((BUDGET - ($(date +%s) - START)))
    if [ "$left" -lt 20 ]; then
        record "$name" skipped 0 0 "the check's ${BUDGET} s were spent"
        return
    fi
    [ "$limit" -gt $((left - 10)) ] && limit=$((left - 10))
    began=$(date +%s)
    timeout --kill-after=15 "$limit" "$@" >"$OUT/$name.log" 2>&1 </dev/null
    rc=$?
    seconds=$(($(date +%s) - began))
    case $rc in
        0) status=ok ;;
        124 | 137) status=timeout ;;
        *) status=failed ;;
    esac
    record "$name" "$status" "$rc" "$seconds" "limit ${limit} s; $(tail -n 1 "$OUT/$name.log" | cut -c1-200)"
    return $rc
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

export PY WHEELS OUT
export -f wheels_field install gpu_tests
COMMIT=$(wheels_field commit)
export MODELLOAD_COMMIT=${COMMIT:-unknown}
echo "GPU check of modelload (${MODELLOAD_COMMIT}) into $OUT, ${BUDGET} s in all"

run_step env 30 "$PY" benchmarks/gpu/env.py "$OUT/env.json"
if run_step install 150 bash -c install; then INSTALLED=1; fi
if [ "$INSTALLED" = 1 ]; then
    run_step tests 200 bash -c gpu_tests
    bench_limit=$((BUDGET - ($(date +%s) - START) - 10))
    dry=()
    if ! "$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
        echo "no CUDA device here: the benchmark runs dry (a tiny model, the CUDA parts skipped)"
        dry=(--dry)
    fi
    # shellcheck disable=SC2086  # GPU_BENCH_ARGS is a list of flags
    run_step bench "$bench_limit" "$PY" benchmarks/gpu_copy.py --size "$SIZE" --out "$OUT/gpu_copy.jsonl" \
        --budget $((bench_limit > 160 ? bench_limit - 120 : 40)) "${dry[@]}" ${GPU_BENCH_ARGS:-}
else
    record tests skipped 0 0 "the install failed: see install.log"
    record bench skipped 0 0 "the install failed: see install.log"
fi

echo
echo "== tests (tail of tests.log) =="
tail -n 12 "$OUT/tests.log" 2>/dev/null
echo "== benchmark (tail of bench.log) =="
tail -n 30 "$OUT/bench.log" 2>/dev/null
echo "== summary ($(($(date +%s) - START)) s) =="
cat "$SUMMARY"
exit $FAILED
