#!/bin/bash
# Multi-node gated-LoRA training with accelerate + DeepSpeed ZeRO-2: one accelerate launcher per node
# (srun), each starting GPUS_PER_NODE processes through torchrun; DeepSpeed's "standard" multinode
# launcher (configs/accelerate/deepspeed_*.yaml), not its pdsh/ssh one.
#   sbatch --nodes 2 launch/slurm_gated_lora.sh configs/gated_lora/tulu3-8b_k8.yaml [extra train flags]
# Edit the #SBATCH lines for your cluster; GPUS_PER_NODE defaults to 8, ACCELERATE_CONFIG to ZeRO-2
# (configs/accelerate/multi_gpu.yaml: DDP). The same job on one machine: launch/local_2node.sh.
#SBATCH --job-name=mtpkit-gated-lora
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --time=48:00:00
#SBATCH --output=logs/%x-%j.out
set -euo pipefail
CONFIG=${1:?usage: sbatch launch/slurm_gated_lora.sh CONFIG.yaml [train flags]}
shift
export GPUS_PER_NODE=${GPUS_PER_NODE:-8}
export ACCELERATE_CONFIG=${ACCELERATE_CONFIG:-configs/accelerate/deepspeed_zero2.yaml}
export MAIN_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MAIN_PORT=${MAIN_PORT:-29500}
export NUM_PROCESSES=$((SLURM_NNODES * GPUS_PER_NODE))
export CONFIG
mkdir -p logs
# single quotes: $SLURM_NODEID is read by each node's own shell (its machine rank); the train
# flags go through "$@" with their quoting intact
srun --kill-on-bad-exit=1 bash -c 'exec accelerate launch --config_file "$ACCELERATE_CONFIG" \
    --num_machines "$SLURM_NNODES" --machine_rank "$SLURM_NODEID" --num_processes "$NUM_PROCESSES" \
    --main_process_ip "$MAIN_ADDR" --main_process_port "$MAIN_PORT" --rdzv_backend static --same_network \
    train/gated_lora.py --config "$CONFIG" "$@"' bash "$@"
