#!/usr/bin/env bash
# One device call: GPU correctness check, then train + evaluate + export the built-in model.
# Usage (device machine, repo root, with .carry/corpus carried): bash tools/device_train.sh BUDGET_S [extra trainer args]
set -uo pipefail
budget=${1:-480}; shift || true
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
timeout 120 python3 tools/gpu_check.py --out "$OUT/gpu_check.json" 2>&1 | tail -12
run=/tmp/train_run
python3 -m tinyloop.train --data .carry/corpus --out "$run" --time-budget-s "$budget" --device cuda \
  --no-progress --log-every 50 "$@" 2>&1 | tee "$OUT/train.log" | grep -v "^step" | tail -40
grep "^step" "$OUT/train.log" | awk 'NR % 10 == 1' | tail -30
for f in tiny.tinyloop metrics.json train_log.jsonl weights_fp16.index.json weights_fp16-00001-of-00002.safetensors weights_fp16-00002-of-00002.safetensors; do
  [ -f "$run/$f" ] && cp "$run/$f" "$OUT/$f"
done
ls -la "$OUT"
