#!/usr/bin/env bash
# colosync demo on one H200 (no Ray, no vLLM there): hf engine on CUDA in an EngineProcess, the
# trainer in an ActorProcess, this process the controller; both peak-device modes, then the
# gpu-marked demo tests. Run from the repository root with the wheels in .whl/; writes to $OUT.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
OUT=${OUT:-/tmp/demo-out}; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch, transformers, peft; print(torch.__version__, torch.version.cuda, transformers.__version__, peft.__version__)"; date -u; } > "$OUT/env.txt" 2>&1
for mode in gpu cpu; do
  timeout 75 python3 -m colosync.tools.cli demo --device cuda --launcher process --engine hf --steps 5 \
    --peak-device $mode --json --report "$OUT/demo-cuda-$mode.json" > /dev/null 2> "$OUT/demo-cuda-$mode.txt"
  echo "rc=$?" >> "$OUT/demo-cuda-$mode.txt"
done
timeout 80 python3 -m pytest -x -q -p no:cacheprovider -rs tests/demo/test_demo.py -k cuda > "$OUT/pytest-gpu.txt" 2>&1
echo "rc=$?" >> "$OUT/pytest-gpu.txt"
tail -n 4 "$OUT"/*.txt
