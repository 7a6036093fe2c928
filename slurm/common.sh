# Shared body of slurm/train_*.sh (sourced; HEAD and DEFAULT_STRATEGY are set by the caller).
#
# Runs one training task per GPU (or per CPU process) on every allocated node through `srun`.
# Lightning detects the Slurm environment itself (SLURMEnvironment: ranks from SLURM_PROCID /
# SLURM_LOCALID / SLURM_NODEID); train.devices=auto resolves to SLURM_NTASKS_PER_NODE and
# train.num_nodes is set from SLURM_JOB_NUM_NODES.  MASTER_ADDR is the first host of the node list.
#
# Resume: the run directory is <output_root>/runs/<head>/<job name>-<job id> (the job id survives
# `--requeue`), and resume=auto continues from its newest checkpoint (checkpoints/last.ckpt; on
# SIGUSR1/SIGTERM the run writes it at the next optimizer-step boundary and stops, train.resume.Preemption).
#
# Environment knobs: DRAFTHEADS_REPO (checkout; default: the sbatch submit directory),
# PYTHON (default: $DRAFTHEADS_REPO/.venv/bin/python), RUN_NAME, MASTER_PORT.
# Every argument of the script is passed to `python -m train` as a key=value override (last wins).
set -euo pipefail
REPO=${DRAFTHEADS_REPO:-${SLURM_SUBMIT_DIR:-$(pwd)}}
cd "$REPO"
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
if [ -z "${SLURM_JOB_ID:-}" ]; then
  echo "$0: not inside a Slurm job; submit with sbatch" >&2
  exit 2
fi
NODES=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
MASTER_ADDR=$(scontrol show hostnames "${SLURM_JOB_NODELIST}" | head -n 1)
export MASTER_ADDR
export MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
export TOKENIZERS_PARALLELISM=false
RUN_NAME=${RUN_NAME:-${SLURM_JOB_NAME}-${SLURM_JOB_ID}}
echo "draftheads: head=$HEAD nodes=$NODES tasks=${SLURM_NTASKS:-?} master=$MASTER_ADDR:$MASTER_PORT run=$RUN_NAME restart=${SLURM_RESTART_COUNT:-0}"
srun --kill-on-bad-exit=1 "$PYTHON" -m train \
  "heads=$HEAD" "strategy=$DEFAULT_STRATEGY" "train.num_nodes=$NODES" "train.run_name=$RUN_NAME" resume=auto \
  "$@"
