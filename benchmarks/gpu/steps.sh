# Shared by check.sh and recheck.sh (sourced, not run): one JSON line per step in $SUMMARY, each step's
# output in $OUT/NAME.log under a time limit that keeps the whole script within $BUDGET seconds of $START.
# The caller sets PY, OUT, SUMMARY, BUDGET and START; FAILED becomes 1 when a step does not pass.

FAILED=${FAILED:-0}

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
