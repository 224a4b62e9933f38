#!/usr/bin/env bash
# Session 8 on the H200, one device call: OUT=<dir> bash benchmarks/h200-shm/run.sh [STEP...]
#   ab       seed-lora over shm, the tree in .ab/old (the commit before a change) and this tree, alternated PAIRS (2) times
#   trace    seed-lora over shm with both processes traced (../h200-latency/trace), timeline in $OUT
# .ab/old is made here before the call: rm -rf .ab && mkdir -p .ab/old && git archive <commit> colosync | tar -x -C .ab/old
set -u
OUT=${OUT:?}
SITE=${SITE:-/tmp/site}
export PYTHONUNBUFFERED=1 COLUMNS=200 PYTHONPATH=$SITE:$PWD
LAT=benchmarks/h200-latency
shm() {  # run from the tree whose colosync is imported (python -m puts the working directory first)
  timeout 60 python3 -m colosync.tools.cli bench --workload seed-lora --transports shm --references none --no-floor \
    --repeats 20 --out /tmp/shm.json "$@" 2>&1 | grep -E "^(│ )?shm"
}
steps=${*:-ab trace}
for what in $steps; do
  case $what in
  ab)
    for v in $(for _ in $(seq ${PAIRS:-2}); do echo old new; done); do
      echo "=== shm: $v ($(date -u +%T))"
      if [ $v = old ]; then (cd .ab/old && PYTHONPATH=$SITE:$PWD shm); else shm; fi
    done 2>&1 | tee -a "$OUT/ab.log" ;;
  trace)
    rm -rf /tmp/trace && mkdir -p /tmp/trace
    COLOSYNC_TRACE_DIR=/tmp/trace PYTHONPATH=$LAT/trace:$PYTHONPATH shm | tee -a "$OUT/ab.log"
    python3 $LAT/timeline.py /tmp/trace --last 20 >"$OUT/timeline.txt" 2>&1 ;;
  *) echo "unknown step $what" ;;
  esac
done
