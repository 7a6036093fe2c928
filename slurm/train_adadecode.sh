#!/bin/bash
# Train the AdaDecode per-layer heads on N nodes x G GPUs, DeepSpeed ZeRO-2 through Lightning (see slurm/common.sh).
#
#   sbatch slurm/train_adadecode.sh [key=value ...]        # e.g. strategy=deepspeed_zero3 train.max_steps=20000
#
# sbatch command-line options beat the #SBATCH lines below.  Smaller clusters:
#   one node, 2 GPUs:  sbatch --nodes=1 --ntasks-per-node=2 --gres=gpu:2 slurm/train_adadecode.sh
#   CPUs only (CI):    sbatch --gres=none --nodes=1 --ntasks-per-node=2 --cpus-per-task=1 slurm/train_adadecode.sh \
#                        train.accelerator=cpu train.batch_size=2 ...
# Keep --ntasks-per-node equal to the GPUs per node: Lightning runs one task per device.
#SBATCH --job-name=draftheads-adadecode
#SBATCH --nodes=2                 # N nodes
#SBATCH --ntasks-per-node=8       # one task per GPU
#SBATCH --gres=gpu:8              # G GPUs per node
#SBATCH --cpus-per-task=8         # DataLoader workers per task (the cache is memory-mapped)
#SBATCH --mem=0                   # all of each node's memory
#SBATCH --time=24:00:00
#SBATCH --requeue                 # preempted or failed node: Slurm requeues, resume=auto continues
#SBATCH --signal=SIGUSR1@180      # 3 min before the limit: checkpoint at the next step boundary, stop, requeue
#SBATCH --open-mode=append        # a requeued job appends to the same log
#SBATCH --output=%x-%j.out
HEAD=adadecode
DEFAULT_STRATEGY=${DEFAULT_STRATEGY:-deepspeed_zero2}
source "${DRAFTHEADS_REPO:-${SLURM_SUBMIT_DIR:-.}}/slurm/common.sh"
