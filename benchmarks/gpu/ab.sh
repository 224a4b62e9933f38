#!/usr/bin/env bash
# seed-lora before and after a change, alternated in one device call (same GPU, same lease):
#   OLD=<checkout of the tree before> OUT=<dir> PAIRS=3 bash benchmarks/gpu/ab.sh
# Each run is `colosync bench --workload seed-lora --arena --repeats 20` (the references and the
# floors included, fingerprints and NaN/Inf checks on); its JSON goes to $OUT/{old,new}-N.json,
# and ab_summary.py prints the medians side by side.
set -u
OUT=${OUT:?} OLD=${OLD:?}
export PYTHONUNBUFFERED=1
bench() { timeout 240 python3 -m colosync.tools.cli bench --workload seed-lora --arena --repeats 20 --out "$1" >/dev/null; }
for i in $(seq "${PAIRS:-3}"); do
  for v in old new; do
    echo "=== $v $i ($(date -u +%T))"
    if [ $v = old ]; then (cd "$OLD" && PYTHONPATH=${SITE:-}:$PWD bench "$OUT/old-$i.json"); else PYTHONPATH=${SITE:-}:$PWD bench "$OUT/new-$i.json"; fi
  done
done
python3 "$(dirname "$0")/ab_summary.py" "$OUT" --json "$OUT/summary.json"
