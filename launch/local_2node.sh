#!/bin/bash
# A 2-node job on one machine: two launchers, one process per "node", rendezvous on 127.0.0.1 at a
# free port, exactly as launch/slurm_*.sh start one launcher per node of a cluster.
#   launch/local_2node.sh accelerate gated_lora DDP   [train flags]   # accelerate launch --num_machines 2 ...
#   launch/local_2node.sh accelerate mtpc       ZERO2 [train flags]   # DeepSpeed ZeRO-2 (ZERO3: ZeRO-3)
#   launch/local_2node.sh torchrun   mtpc       DDP   [train flags]   # torchrun --nnodes 2 --node_rank 0|1 ...
# Each node's lines are prefixed [node 0] / [node 1]; the script exits non-zero when either node
# fails, and then stops the other. Without a GPU the processes use gloo (train/engine.py setup).
# PYTHON (default: the project's .venv) picks the environment; PORT a fixed port.
set -uo pipefail
usage="usage: launch/local_2node.sh accelerate|torchrun gated_lora|mtpc DDP|ZERO2|ZERO3 [train flags]"
LAUNCHER=${1:?$usage}
TRAINER=${2:?$usage}
MODE=${3:?$usage}
shift 3
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
BIN=$(dirname "$PYTHON")
case $LAUNCHER in accelerate|torchrun) ;; *) echo "$usage" >&2; exit 2 ;; esac
case $TRAINER in gated_lora|mtpc) ;; *) echo "$usage" >&2; exit 2 ;; esac
case $MODE in
    DDP) ACCELERATE_CONFIG=configs/accelerate/cpu_ddp.yaml ;;
    ZERO2) ACCELERATE_CONFIG=configs/accelerate/deepspeed_zero2.yaml ;;
    ZERO3) ACCELERATE_CONFIG=configs/accelerate/deepspeed_zero3.yaml ;;
    *) echo "$usage" >&2; exit 2 ;;
esac
[ "$LAUNCHER" = torchrun ] && [ "$MODE" != DDP ] && { echo "torchrun runs DDP only; DeepSpeed goes through accelerate" >&2; exit 2; }
PORT=${PORT:-$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

node() {  # node RANK: this node's launcher, as a cluster would start it on node RANK
    case $LAUNCHER in
        accelerate) exec "$BIN/accelerate" launch --config_file "$ACCELERATE_CONFIG" \
            --num_machines 2 --machine_rank "$1" --num_processes 2 \
            --main_process_ip 127.0.0.1 --main_process_port "$PORT" --rdzv_backend static --same_network \
            "train/$TRAINER.py" "${@:2}" ;;
        torchrun) exec "$BIN/torchrun" --nnodes 2 --node_rank "$1" --nproc_per_node 1 \
            --master_addr 127.0.0.1 --master_port "$PORT" \
            "train/$TRAINER.py" "${@:2}" ;;
    esac
}

echo "[local_2node] $LAUNCHER $TRAINER $MODE: 2 nodes x 1 process, rendezvous 127.0.0.1:$PORT"
start=$(date +%s)
# node 1 in its own process group (setsid), so it can be stopped whole if node 0 fails
setsid bash -c "set -o pipefail; $(declare -f node); LAUNCHER=$LAUNCHER TRAINER=$TRAINER ACCELERATE_CONFIG=$ACCELERATE_CONFIG \
    PORT=$PORT BIN=$BIN node 1 \"\$@\" 2>&1 | sed -u 's/^/[node 1] /'" bash "$@" &
node1=$!
trap 'kill -- -$node1 2>/dev/null' EXIT INT TERM
(node 0 "$@") 2>&1 | sed -u 's/^/[node 0] /'
rc0=${PIPESTATUS[0]}
if [ "$rc0" -ne 0 ]; then
    kill -- -"$node1" 2>/dev/null
fi
wait "$node1"
rc1=$?
trap - EXIT INT TERM
echo "[local_2node] node 0 exit $rc0, node 1 exit $rc1, $(( $(date +%s) - start )) s"
[ "$rc0" -eq 0 ] && [ "$rc1" -eq 0 ]
