# Shared by check.sh and recheck.sh (sourced, not run, with the script's arguments): OUT and WHEELS from
# them, one JSON line per step in $OUT/summary.jsonl, each step's output in $OUT/NAME.log under a time limit
# that keeps the whole script within $BUDGET seconds of $START (the caller sets BUDGET). FAILED becomes 1
# when a step does not pass.

OUT=${1:-}
if [ -z "$OUT" ]; then
    echo "usage: $0 OUT [WHEELS]  (OUT: a folder for the figures and logs)" >&2
    exit 2
fi
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT" || exit 2
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
WHEELS=${2:-${GPU_WHEELS:-$ROOT/.gpu-wheels}}
PY=${GPU_CHECK_PYTHON:-python3}
START=$(date +%s)
SUMMARY=$OUT/summary.jsonl
: >"$SUMMARY"
FAILED=0
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1

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
    if [ "$left" -lt "${STEP_MIN_LEFT:-20}" ]; then
        record "$name" skipped 0 0 "the script's ${BUDGET} s were spent"
        return 1
    fi
    [ "$limit" -gt $((left - ${STEP_RESERVE:-10})) ] && limit=$((left - ${STEP_RESERVE:-10}))
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

bench_dry() { # the benchmark's --dry where there is no GPU (said on stderr), nothing where there is one
    # nvidia-smi answers in a fraction of the second an import of torch takes; a GPU that torch cannot
    # use after all is the benchmark's to report (it skips its CUDA parts, saying so)
    if ! { command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; }; then
        echo "no GPU here: the benchmark runs dry (a tiny model, the CUDA parts skipped)" >&2
        echo --dry
    fi
}

finish() { # TESTS_LINES BENCH_LINES: the ends of the logs and the summary on the terminal; exit with FAILED
    echo
    echo "== tests (tail of tests.log) =="
    tail -n "$1" "$OUT/tests.log" 2>/dev/null
    echo "== benchmark (tail of bench.log) =="
    tail -n "$2" "$OUT/bench.log" 2>/dev/null
    echo "== summary ($(($(date +%s) - START)) s) =="
    cat "$SUMMARY"
    exit "$FAILED"
}
