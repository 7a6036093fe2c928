#!/usr/bin/env bash
# Issue 17's GPU check, as one short run on one GPU (about 5 minutes on an H100/H200 class card):
# a random ~1.1B Llama in bf16, online training (train.features=online) of ctc, falcon and
# adadecode for a few steps under DeepSpeed ZeRO-2 and ZeRO-3, the export == in-memory check,
# and training tokens/s.  No download.  Figures: <out>/gpu_check.json and the printed table.
#   bash scripts/gpu_check.sh [OUT_DIR] [extra args for scripts/gpu_check.py]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-outputs/gpu_check}; shift || true
PY=${PYTHON:-.venv/bin/python}; [ -x "$PY" ] || PY=python
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "gpu_check.sh: no CUDA device visible")'
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
exec "$PY" scripts/gpu_check.py --out "$OUT" --strategies deepspeed_zero2,deepspeed_zero3 --steps 6 "$@"
