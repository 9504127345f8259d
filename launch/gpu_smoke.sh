#!/usr/bin/env bash
# The whole pipeline once, small, on one device: self-distil 16 prompts, 20 optimizer steps of
# each trainer (gated LoRA on the default backbone, MTPC on a byte backbone), export both heads,
# then bench AR / probe / gated LoRA (on the default backbone) and AR / MTPC (on the byte
# backbone) through the shared decoder, and print tokens/s and tau of each.
#
#   bash launch/gpu_smoke.sh                                   # a GPU node: cuda, bfloat16
#   bash launch/gpu_smoke.sh --device cpu --dtype float32 \
#       --backbone tiny-llama-random --byte-backbone tiny-byte-llama-random   # the test's run
#
# Flags (each optional):
#   --device D          auto | cpu | cuda | cuda:N for every command (default: auto)
#   --dtype T           weight dtype of the target in distillation, training and bench (default: bfloat16)
#   --backbone B        target of the distillation, the gated-LoRA head and the probe (default: smollm2-135m-instruct)
#   --byte-backbone B   byte-level target of MTPC (default: mtpkit-byte-lm; when it is not installed,
#                       a tiny one is trained and installed first: --byte-lm-steps steps)
#   --byte-lm-steps N   steps of that byte LM (default: 300)
#   --steps N           optimizer steps of each trainer (default: 20)
#   --prompts N         prompts distilled (default: 16)
#   --tokens N          new tokens per bench prompt (default: 64)
#   --mtpc-flags "F"    extra train/mtpc.py flags, after the others (default: none; the test's CPU run
#                       takes fewer windows a sequence)
#   --out DIR           where everything goes; replaced (default: runs/gpu_smoke)
#   --python PY         interpreter (default: python)
set -euo pipefail
DEVICE=auto DTYPE=bfloat16 BACKBONE=smollm2-135m-instruct BYTE_BACKBONE=mtpkit-byte-lm BYTE_LM_STEPS=300
STEPS=20 PROMPTS=16 TOKENS=64 OUT=runs/gpu_smoke PY=python MTPC_FLAGS=""
while [ $# -gt 0 ]; do
    case "$1" in
        --device) DEVICE=$2 ;;
        --dtype) DTYPE=$2 ;;
        --backbone) BACKBONE=$2 ;;
        --byte-backbone) BYTE_BACKBONE=$2 ;;
        --byte-lm-steps) BYTE_LM_STEPS=$2 ;;
        --steps) STEPS=$2 ;;
        --prompts) PROMPTS=$2 ;;
        --tokens) TOKENS=$2 ;;
        --mtpc-flags) MTPC_FLAGS=$2 ;;
        --out) OUT=$2 ;;
        --python) PY=$2 ;;
        -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
        *) echo "launch/gpu_smoke.sh: unknown flag $1 (see --help)" >&2; exit 2 ;;
    esac
    shift 2 || { echo "launch/gpu_smoke.sh: $1 needs a value" >&2; exit 2; }
done
cd "$(dirname "$0")/.."
DEV=(--device "$DEVICE")
read -r -a MTPC_EXTRA <<< "$MTPC_FLAGS"
rm -rf "$OUT"
mkdir -p "$OUT"
log() { echo "[gpu_smoke $(date +%H:%M:%S)] $*"; }

log "device $DEVICE, dtype $DTYPE, backbone $BACKBONE, byte backbone $BYTE_BACKBONE"
"$PY" -c "import torch; print('[gpu_smoke] torch', torch.__version__, 'cuda', torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"

log "1/6 self-distil $PROMPTS prompts"
"$PY" data/distill.py --backbone "$BACKBONE" --data builtin:train --limit "$PROMPTS" --max-new-tokens 48 \
    --batch-size 8 --out "$OUT/distilled.jsonl" "${DEV[@]}" --dtype "$DTYPE"

log "2/6 gated LoRA: $STEPS steps, export"
"$PY" train/gated_lora.py --config configs/gated_lora/smollm2-135m_k4.yaml --backbone "$BACKBONE" \
    --data "$OUT/distilled.jsonl" --output-dir "$OUT/gated_lora" --k 2 --max-steps "$STEPS" --grad-accum 1 \
    --lr 1e-3 --max-length 160 --save-every "$STEPS" --eval-every 0 "${DEV[@]}" --dtype "$DTYPE" --mixed-precision auto
"$PY" train/export.py --checkpoint "$OUT/gated_lora" --out "$OUT/gated_export"

if [ "$BYTE_BACKBONE" = mtpkit-byte-lm ] && ! "$PY" -c "
from mtpkit.models.backbone import BYTE_LM, cache_dir; import sys
sys.exit(0 if (cache_dir() / BYTE_LM / 'config.json').is_file() else 1)"; then
    log "3/6 mtpkit-byte-lm is not installed: training one for $BYTE_LM_STEPS steps"
    "$PY" train/byte_lm.py --config configs/byte_lm/byte-llama-12m.yaml --data builtin \
        --output-dir "$OUT/byte_lm" --max-steps "$BYTE_LM_STEPS" --eval-every 0 --save-every "$BYTE_LM_STEPS" \
        --install 1 "${DEV[@]}"
else
    log "3/6 byte backbone $BYTE_BACKBONE is there"
fi

log "4/6 byte-level self-distillation ($PROMPTS prompts) and MTPC: $STEPS steps, export"
"$PY" data/distill.py --backbone "$BYTE_BACKBONE" --data builtin:train --limit "$PROMPTS" --max-new-tokens 128 \
    --batch-size 8 --out "$OUT/byte_distilled.jsonl" "${DEV[@]}" --dtype "$DTYPE"
"$PY" train/mtpc.py --config configs/mtpc/byte-llama-12m_btree_n16.yaml --backbone "$BYTE_BACKBONE" \
    --data "$OUT/byte_distilled.jsonl" --output-dir "$OUT/mtpc" --max-steps "$STEPS" --save-every "$STEPS" \
    --eval-every 0 "${DEV[@]}" --dtype "$DTYPE" --mixed-precision auto ${MTPC_EXTRA[@]+"${MTPC_EXTRA[@]}"}
"$PY" train/export.py --checkpoint "$OUT/mtpc" --out "$OUT/mtpc_export"

log "5/6 bench AR / probe / gated LoRA on $BACKBONE"
"$PY" eval/bench.py --backbone "$BACKBONE" --data builtin:eval --per-category 2 --max-new-tokens "$TOKENS" \
    --methods ar probe:bc=10 "gated_lora:head=$OUT/gated_export,decoding=linear" \
    --out "$OUT/bench/results.json" "${DEV[@]}" --dtype "$DTYPE"

log "6/6 bench AR / MTPC on $BYTE_BACKBONE"
"$PY" eval/bench.py --backbone "$BYTE_BACKBONE" --data builtin:eval --per-category 2 --max-new-tokens "$((TOKENS * 3))" \
    --methods ar "mtpc:head=$OUT/mtpc_export" --out "$OUT/bench_mtpc/results.json" "${DEV[@]}" --dtype "$DTYPE"

"$PY" - "$OUT/bench/results.json" "$OUT/bench_mtpc/results.json" <<'EOF'
import json, re, sys
print("\n[gpu_smoke] summary")
print(f"{'backbone':<28} {'method':<48} {'device':<8} {'dtype':<9} {'tok/s':>8} {'tau':>6} {'vs AR':>6} {'= AR':>5}")
for path in sys.argv[1:]:
    run = json.load(open(path))
    cfg = run.get("config", {})
    for name, m in run["methods"].items():
        name = re.sub(r"head=[^,]*/", "head=", name)  # the export folder by its last name
        num = lambda key, fmt: "-" if m.get(key) is None else format(m[key], fmt)  # hf_ar has no tau
        print(f"{str(cfg.get('backbone', '?'))[-28:]:<28} {name[-48:]:<48} {str(cfg.get('device', '?')):<8} "
              f"{str(cfg.get('dtype', '?')):<9} {num('tokens_per_s', '.1f'):>8} {num('tau', '.2f'):>6} "
              f"{num('speedup_vs_ar', '.2f'):>6} {str(m.get('matches_ar', '')):>5}")
EOF
log "done: $OUT"
