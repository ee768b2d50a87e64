#!/usr/bin/env bash
# The whole suite, several times in a row, with CPU-burning processes beside it: a suite that only
# passes on a quiet machine fails here. Run it after any change to the rank pool or to a test's bounds.
#
#   tests/stress.sh [RUNS] [BURNERS] [pytest args...]     defaults: 3 runs, 2 burners
#
# Each run's log goes to stress-logs/run-N.log; the last lines say how long each run took.
set -uo pipefail
cd "$(dirname "$0")/.."
runs="${1:-3}"; burners="${2:-2}"
shift $(( $# < 2 ? $# : 2 ))
logs=stress-logs
mkdir -p "$logs"

pids=()
stop_burners() { [ ${#pids[@]} -eq 0 ] || kill "${pids[@]}" 2>/dev/null; wait 2>/dev/null; }
trap stop_burners EXIT
trap 'exit 130' INT TERM
for _ in $(seq "$burners"); do
  ( while :; do :; done ) &   # one core's worth of busy loop
  pids+=($!)
done
echo "stress: $runs run(s) of ./lab.sh test with $burners CPU burner(s) on $(nproc) core(s)"

failed=0
summary=()
for i in $(seq "$runs"); do
  start=$(date +%s)
  ./lab.sh test "$@" >"$logs/run-$i.log" 2>&1
  rc=$?
  secs=$(( $(date +%s) - start ))
  result=$(grep -E '^=+ .*(passed|failed|error).* =+$' "$logs/run-$i.log" | tail -n 1 | tr -d '=')
  line="run $i: exit $rc in $((secs / 60)) min $((secs % 60)) s:${result:- no pytest summary}"
  echo "$line"
  summary+=("$line")
  [ "$rc" -eq 0 ] || failed=$((failed + 1))
done
echo "stress: $((runs - failed)) of $runs run(s) green"
[ "$failed" -eq 0 ]
