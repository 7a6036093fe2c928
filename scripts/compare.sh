#!/usr/bin/env bash
# The comparison of record (issue 18) in one command: one cache, every head trained for the same
# wall-clock budget, all evaluated with one protocol (MT-bench, every turn, per category, repeated
# timing), summary.md at the end.  Settings: configs/compare.yaml; key=value arguments override it
# (e.g. train_max_time=600 'heads_to_run=[ctc,falcon]'); --dry-run lists the stages.
# Re-running the same command resumes: finished stages are skipped, interrupted ones continue.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export WANDB_MODE=${WANDB_MODE:-offline}
exec "$PY" scripts/compare.py "$@"
