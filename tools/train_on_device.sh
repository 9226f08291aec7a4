#!/usr/bin/env bash
# Train the built-in `tiny` model on one CUDA GPU within a wall-clock budget, then evaluate and export.
#
#   bash tools/train_on_device.sh OUT_DIR BUDGET_S [extra python -m tinyloop.train flags...]
#
# Run from the repository root with the corpus at .carry/corpus (built by python -m tinyloop.train.corpus).
# BUDGET_S covers training, the final checkpoint, evaluation and the INT4 export; leave ~40 s below the
# hard limit for Python/CUDA start-up (e.g. 540 for a 600 s limit). The package need not be installed.
# Outputs in OUT_DIR: tiny.tinyloop (INT4), weights_fp16*.safetensors (+ index), metrics.json,
# train_log.jsonl, train_stdout.log, ckpt.pt (large: stays on the machine unless copied).
# Env: BATCH (64), SEQ (1024), LR (1e-3), SEED (0), PROGRESS=1 for a tqdm bar (off: log lines only).
set -euo pipefail

OUT="${1:?usage: train_on_device.sh OUT_DIR BUDGET_S [flags...]}"
BUDGET="${2:?usage: train_on_device.sh OUT_DIR BUDGET_S [flags...]}"
shift 2
mkdir -p "$OUT"

progress=(--no-progress)
if [[ "${PROGRESS:-0}" == "1" ]]; then progress=(); fi

{
  echo "== $(date -u +%FT%TZ) $(python3 --version 2>&1) on $(hostname)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
  PYTHONUNBUFFERED=1 PYTHONPATH=src python3 -c \
    'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available())'
} 2>&1 | tee "$OUT/train_stdout.log"

PYTHONUNBUFFERED=1 PYTHONPATH=src python3 -m tinyloop.train \
  --data .carry/corpus --out "$OUT" --time-budget-s "$BUDGET" --device cuda --config tiny \
  --batch-size "${BATCH:-64}" --seq-len "${SEQ:-1024}" --lr "${LR:-1e-3}" --seed "${SEED:-0}" \
  "${progress[@]}" "$@" 2>&1 | tee -a "$OUT/train_stdout.log"

ls -la "$OUT" | tee -a "$OUT/train_stdout.log"
