#!/usr/bin/env bash
# The colocated step on one H200 at 16 GB: `colosync bench-step` (synthetic
# engine with 16 GB of bf16 weights and a KV cache filling the GPU; synthetic trainer with the same
# 16 GB of bf16 weights, a 16 GB bf16 gradient buffer and the fp32 Adam moments of one rank of a
# 4-way distributed optimizer), 10 steps, a full 16 GB sync inside every train->rollout handoff;
# then the gpu tests of the synthetic engine and of bench-step. One mode per run (~100 s each):
#   OUT=<dir> BENCH_ARGS='--peak-device gpu --steps 4' bash benchmarks/colocated-step/run.sh     # record.json
#   BENCH_ARGS='--peak-device cpu' (cpu-mode.json); BENCH_ARGS='--peak-device gpu --steps 4 --trainer-backend tms' (tms.json)
# (the last needs torch_memory_saver's wheel in .whl/). Run from the repository root with the
# wheels in .whl/ (the H200 host has no msgspec); writes to $OUT.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
OUT=${OUT:-benchmarks/colocated-step/out}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; free -g | head -2; python3 -c "import torch; print(torch.__version__, torch.version.cuda)"; date -u; } > "$OUT/env.txt" 2>&1
PYTHONUNBUFFERED=1 timeout ${BENCH_TIMEOUT:-330} python3 -m colosync.tools.cli bench-step --weights 16GB --optimizer-shards 4 --steps 10 ${BENCH_ARGS:-} --report "$OUT/bench-step.json" 2>&1 | tee "$OUT/bench-step.txt"
echo "rc=${PIPESTATUS[0]}" | tee -a "$OUT/bench-step.txt"
timeout ${TEST_TIMEOUT:-200} python3 -m pytest -v -m gpu -p no:cacheprovider -o addopts="" --timeout 100 --tb=short -rfE tests/tools/test_step_bench.py tests/engines/test_synthetic.py tests/handoff/backends/test_tms_trainer.py > "$OUT/pytest-gpu.txt" 2>&1
echo "rc=$?" >> "$OUT/pytest-gpu.txt"
tail -n 30 "$OUT/pytest-gpu.txt"
