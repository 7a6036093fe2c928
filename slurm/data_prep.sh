#!/bin/bash
# Prepare the hidden-state / greedy-label cache with T Slurm tasks in parallel.
#
#   sbatch slurm/data_prep.sh [key=value ...]      # e.g. data.max_conversations=null prep.layers=[8,15,22]
#
# Every task runs `python -m data_prep` with SLURM_PROCID / SLURM_NTASKS as its rank / world size
# (data_prep.cache.rank_world): task r writes shards r, r+T, r+2T, ... and any T gives the same
# cache.  Finished shards are skipped on a re-run (checksummed sidecars), so `--requeue` simply
# restarts and continues; the last task to finish writes manifest.json.
# Smaller cluster: sbatch --nodes=1 --ntasks=2 --gres=gpu:2 slurm/data_prep.sh
# CPUs only:       sbatch --gres=none --ntasks=2 --cpus-per-task=1 slurm/data_prep.sh model.dtype=float32
#SBATCH --job-name=draftheads-prep
#SBATCH --nodes=1                 # N nodes
#SBATCH --ntasks-per-node=8       # one task per GPU: T = N x 8 shard writers
#SBATCH --gres=gpu:8
#SBATCH --cpus-per-task=8
#SBATCH --mem=0
#SBATCH --time=12:00:00
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=%x-%j.out
set -euo pipefail
REPO=${DRAFTHEADS_REPO:-${SLURM_SUBMIT_DIR:-$(pwd)}}
cd "$REPO"
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
export TOKENIZERS_PARALLELISM=false
# The cache is addressed by a hash of its config, so every task derives the same directory.  Each
# task must see only its own GPU: Slurm's --gres binds one per task when ntasks-per-node = GPUs.
# RANK / WORLD_SIZE are unset so data_prep reads SLURM_PROCID / SLURM_NTASKS.
srun --kill-on-bad-exit=1 env -u RANK -u WORLD_SIZE bash -c \
  'export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-${SLURM_LOCALID}}; exec "$0" -m data_prep "$@"' \
  "$PYTHON" "$@"
