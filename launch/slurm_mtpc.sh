#!/bin/bash
# Multi-node MTPC training with torchrun (DDP over NCCL): one torchrun per node (srun), static
# rendezvous at the first node, each node's rank from its own SLURM_NODEID.
#   sbatch --nodes 2 launch/slurm_mtpc.sh configs/mtpc/evabyte-6.5b_btree_n16_heads.yaml [extra train flags]
# Edit the #SBATCH lines for your cluster; GPUS_PER_NODE defaults to 8. `--n 16` works after the
# script once mtpkit's torchrun hook is installed (train/torchrun_args.py); `-n 16` works everywhere.
# The same job on one machine: launch/local_2node.sh torchrun mtpc DDP.
#SBATCH --job-name=mtpkit-mtpc
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=48:00:00
#SBATCH --output=logs/%x-%j.out
set -euo pipefail
CONFIG=${1:?usage: sbatch launch/slurm_mtpc.sh CONFIG.yaml [train flags]}
shift
export GPUS_PER_NODE=${GPUS_PER_NODE:-8}
export MAIN_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MAIN_PORT=${MAIN_PORT:-29500}
export CONFIG
mkdir -p logs
# single quotes: $SLURM_NODEID is read by each node's own shell (its node rank)
srun --kill-on-bad-exit=1 bash -c 'exec torchrun --nnodes "$SLURM_NNODES" --node_rank "$SLURM_NODEID" \
    --nproc_per_node "$GPUS_PER_NODE" --master_addr "$MAIN_ADDR" --master_port "$MAIN_PORT" \
    train/mtpc.py --config "$CONFIG" "$@"' bash "$@"
