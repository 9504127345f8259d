#!/bin/bash
# Multi-node MTPC training with torchrun (DDP over NCCL; one torchrun per node, c10d rendezvous).
#   sbatch --nodes 2 launch/slurm_mtpc.sh configs/mtpc/evabyte-6.5b_btree_n16_heads.yaml [extra train flags]
# Under torchrun the window flag is `-n 16` (torchrun rejects `--n`). GPUS_PER_NODE defaults to 8.
#SBATCH --job-name=mtpkit-mtpc
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=48:00:00
#SBATCH --output=logs/%x-%j.out
set -euo pipefail
CONFIG=${1:?usage: sbatch launch/slurm_mtpc.sh CONFIG.yaml [train flags]}
shift
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MAIN_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MAIN_PORT=${MAIN_PORT:-29500}
mkdir -p logs
srun --kill-on-bad-exit=1 torchrun \
    --nnodes "$SLURM_NNODES" --nproc_per_node "$GPUS_PER_NODE" \
    --rdzv_id "$SLURM_JOB_ID" --rdzv_backend c10d --rdzv_endpoint "$MAIN_ADDR:$MAIN_PORT" \
    train/mtpc.py --config "$CONFIG" "$@"
