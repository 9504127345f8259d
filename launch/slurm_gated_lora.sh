#!/bin/bash
# Multi-node gated-LoRA training with accelerate + DeepSpeed ZeRO-2 (one launcher per node).
#   sbatch --nodes 2 launch/slurm_gated_lora.sh configs/gated_lora/tulu3-8b_k8.yaml [extra train flags]
# Edit the #SBATCH lines for your cluster; GPUS_PER_NODE defaults to 8.
#SBATCH --job-name=mtpkit-gated-lora
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=48:00:00
#SBATCH --output=logs/%x-%j.out
set -euo pipefail
CONFIG=${1:?usage: sbatch launch/slurm_gated_lora.sh CONFIG.yaml [train flags]}
shift
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
ACCELERATE_CONFIG=${ACCELERATE_CONFIG:-configs/accelerate/deepspeed_zero2.yaml}
MAIN_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MAIN_PORT=${MAIN_PORT:-29500}
NUM_PROCESSES=$((SLURM_NNODES * GPUS_PER_NODE))
mkdir -p logs
# srun starts one accelerate launcher per node; each gets its node rank from SLURM_NODEID
srun --kill-on-bad-exit=1 bash -c "accelerate launch \
    --config_file $ACCELERATE_CONFIG \
    --num_machines $SLURM_NNODES --num_processes $NUM_PROCESSES \
    --machine_rank \$SLURM_NODEID --main_process_ip $MAIN_ADDR --main_process_port $MAIN_PORT \
    train/gated_lora.py --config $CONFIG $*"
