#!/usr/bin/env bash
# The memory handoff on one GPU: the GPU-marked handoff tests, the recorded run of both handoff orders with
# real tensors (engine 16 GB weights + 64 GB KV, trainer 40 GB resident), the trainer sleep/wake
# benchmark of both backends, and the K3 plan. Everything lands in $OUT:
#
#   OUT=/path/to/results bash benchmarks/handoff/run.sh
#
# Needs torch with CUDA, msgspec and rich (matplotlib for the plan's PNG); psutil is optional.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-benchmarks/results/handoff-$(date -u +%Y%m%dT%H%M%SZ)}
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"

"$PY" - <<'PYEOF' || exit 2
import importlib.util, sys
missing = [m for m in ("torch", "msgspec", "rich") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"missing Python packages: {missing}; pip install {' '.join(missing)}")
import torch
if not torch.cuda.is_available():
    sys.exit("no CUDA device: this script records the GPU run")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
PYEOF

status=0
run() {  # run NAME CMD...: log the command and its output to $OUT/NAME.txt
  local name=$1; shift
  echo "== $name: $*"
  { echo "\$ $*"; "$@"; } > "$OUT/$name.txt" 2>&1
  local rc=$?
  tail -n 15 "$OUT/$name.txt"
  [ $rc -eq 0 ] || { echo "!! $name exited $rc"; status=1; }
}

run pytest_gpu "$PY" -m pytest tests/handoff -m gpu -q -p no:cacheprovider
run handoff_gpu "$PY" benchmarks/handoff/gpu_handoff.py --mode gpu --out "$OUT/handoff_gpu.json"
run handoff_cpu "$PY" benchmarks/handoff/gpu_handoff.py --mode cpu --out "$OUT/handoff_cpu.json"
run handoff_bench "$PY" -m colosync.tools.handoff handoff-bench --size 40GB --tensors 400 --repeats 5 \
    --out "$OUT/handoff_bench.json"
run plan_k3 "$PY" -m colosync.tools.handoff plan --workload k3-gb300 --plot "$OUT/plan_k3.png"
"$PY" -m colosync.tools.handoff plan --workload k3-gb300 --json > "$OUT/plan_k3.json" 2>/dev/null

"$PY" - "$OUT" <<'PYEOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for mode in ("gpu", "cpu"):
    p = out / f"handoff_{mode}.json"
    if p.exists():
        d = json.loads(p.read_text()); s = d["summary"]
        print(f"{mode}: host copies peak {s['host_copies_peak_bytes']/1e9:.2f} GB (larger copy "
              f"{s['larger_single_copy_bytes']/1e9:.2f}, both {s['both_copies_bytes']/1e9:.2f}), device peak "
              f"{s['device_peak_bytes']/1e9:.2f} GB, passed={d['passed']} {d['criteria']}")
p = out / "handoff_bench.json"
if p.exists():
    for r in json.loads(p.read_text())["results"]:
        if r.get("available"):
            print(f"bench {r['backend']}: sleep {r['sleep_gbps_median']:.1f} GB/s, wake {r['wake_gbps_median']:.1f} GB/s "
                  f"({r['bytes']/1e9:.1f} GB, verified={r['verified']})")
        else:
            print(f"bench {r['backend']}: unavailable ({r.get('reason')})")
PYEOF
echo "results in $OUT (status $status)"
exit $status
