"""Training throughput: gated-LoRA MTP steps against plain LoRA fine-tuning of the same backbone,
in one or several precisions, and the gated step's two input layouts.

    python eval/bench_train.py --backbone smollm2-135m-instruct --data runs/distilled.jsonl --k 4 --steps 6
    python eval/bench_train.py --precision fp32 bf16-autocast bf16 --steps 8   # bf16 against fp32
    python eval/bench_train.py --sides gated cached --anchors 0.25 --steps 12   # old step against new

Sides: `gated` is the paper's step (one forward over the Figure-4 slots, a mask block after every
loss token), `cached` the cheaper one (`--anchors` share of the blocks, the NTP tokens once
without gradient, the masks over their cached keys/values: `train/gated_lora.py --anchors F
--cache-ntp 1`), `plain` plain LoRA fine-tuning. Each step is timed in phases (inputs, forward
with the losses, backward, optimizer) so the table shows where a step's time goes.

All sides run full optimizer steps (forward, backward, AdamW) with the same LoRA rank and
target modules, on inputs of the SAME total length: a gated-LoRA sequence of n tokens becomes
T = n + k * (loss tokens) Figure-4 slots; plain LoRA trains causal-LM on T real tokens.

Precisions (`--precision`, what the trainers' flags give): `fp32` (fp32 weights, no autocast),
`bf16-autocast` (fp32 weights, the forward under bfloat16 autocast: `--mixed-precision bf16`),
`bf16` (the frozen backbone's weights in bfloat16, the trained LoRA in fp32 as peft keeps it:
`--dtype bfloat16`). Every (side, precision) pair runs one step per sequence, in an order rotated
per step after a warm-up step each, so machine drift hits all alike. Reports tokens/s (input
positions per second) per pair, gated / plain per precision, every precision against the first
one, and each pair's mean loss over the same sequences (a precision that trains a different
model shows there).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import time
from pathlib import Path

import torch

from mtpkit.data.chat import IGNORE, load_examples, tokenize_chat
from mtpkit.data.mtp import choose_anchors, collate_cached, collate_mask_inputs, mask_inputs
from mtpkit.models.backbone import DEFAULT_BACKBONE, load_backbone
from mtpkit.models.gated_lora import GatedLoRAConfig, GatedMTP
from mtpkit.models.atomic_write import write_atomic
from mtpkit.models.process import run_script

PRECISIONS = {"fp32": (torch.float32, False), "bf16-autocast": (torch.float32, True), "bf16": (torch.bfloat16, False)}
"""name -> (weight dtype of the frozen backbone, bfloat16 autocast of the forward)"""
SIDES = ("gated", "cached", "plain")
PHASES = ("inputs", "forward", "backward", "optimizer")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backbone", default=DEFAULT_BACKBONE, help="model name or folder (default: %(default)s)")
    p.add_argument("--data", default="builtin", help="chat data to take sequences from (default: %(default)s)")
    p.add_argument("--k", type=int, default=4, help="mask tokens (default: %(default)s)")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank on both sides (default: %(default)s)")
    p.add_argument("--max-length", type=int, default=256, help="tokens per gated sequence before masks (default: %(default)s)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per pair after 1 warm-up (default: %(default)s)")
    p.add_argument("--precision", nargs="+", default=["fp32"], choices=list(PRECISIONS),
                   help="precisions to compare; ratios are against the first (default: fp32)")
    p.add_argument("--sides", nargs="+", default=["gated", "plain"], choices=SIDES,
                   help="gated = the paper's gated-LoRA MTP step, cached = the cheaper step (--anchors, NTP "
                        "cached), plain = plain LoRA fine-tuning (default: gated plain)")
    p.add_argument("--anchors", type=float, default=0.25,
                   help="share of the loss tokens with a mask block on the cached side (default: %(default)s)")
    p.add_argument("--out", default="runs/bench_train.json", help="results JSON (default: %(default)s)")
    args = p.parse_args(argv)
    if len(set(args.precision)) != len(args.precision):
        p.error("--precision lists the same precision twice")
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    return args


def build(side: str, base, precision: str, k: int, rank: int):
    """(model, optimizer) of `side` on a copy of `base` with the precision's weight dtype."""
    from peft import LoraConfig, get_peft_model

    dtype, _ = PRECISIONS[precision]
    cfg = GatedLoRAConfig(k=k, rank=rank)
    body = copy.deepcopy(base).to(dtype)
    if side in ("gated", "cached"):
        model = GatedMTP(body, cfg).train()
    else:
        model = get_peft_model(body, LoraConfig(r=rank, lora_alpha=cfg.alpha,
                                                target_modules=list(cfg.target_modules))).train()
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)


def main(argv=None) -> dict:
    args = parse_args(argv)
    base, tokenizer = load_backbone(args.backbone)
    examples, _ = load_examples(args.data)
    seqs = []
    for ex in examples:
        f = tokenize_chat(tokenizer, ex.messages, max_length=args.max_length)
        if sum(y != IGNORE for y in f["labels"]) >= 16:
            seqs.append((torch.tensor(f["input_ids"]), torch.tensor(f["labels"])))
    seqs = seqs[: args.steps + 1]
    if len(seqs) < 2:
        raise SystemExit(f"bench_train: {args.data} has too few sequences with 16+ answer tokens")
    all_ids = torch.cat([s[0] for s in seqs])
    pairs = [(side, prec) for prec in args.precision for side in args.sides]
    built = {(side, prec): build(side, base, prec, args.k, args.rank) for side, prec in pairs}
    del base

    full_slots = [mask_inputs(*s, args.k)["input_ids"].numel() for s in seqs]  # T of the paper's layout

    def step(pair, i):
        """One optimizer step of `pair` on sequence i: (seconds per phase, loss)."""
        (side, prec), (model, opt) = pair, built[pair]
        clock = [time.perf_counter()]
        if side == "cached":
            draw = torch.Generator().manual_seed(i)
            batch = collate_cached([mask_inputs(*seqs[i], args.k, choose_anchors(seqs[i][1], args.anchors, draw))])
        elif side == "gated":
            batch = collate_mask_inputs([mask_inputs(*seqs[i], args.k)])
        else:  # real tokens, as many as the gated step's slots
            batch = {"input_ids": all_ids.roll(-i * 97)[: full_slots[i]][None]}
        clock.append(time.perf_counter())
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if PRECISIONS[prec][1] else contextlib.nullcontext()
        with autocast:
            if side == "plain":
                loss = model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
            else:
                loss = model(**batch)["loss"]
        clock.append(time.perf_counter())
        loss.backward()
        clock.append(time.perf_counter())
        opt.step()
        opt.zero_grad()
        clock.append(time.perf_counter())
        return [b - a for a, b in zip(clock, clock[1:])], float(loss)

    times = {pair: [] for pair in pairs}
    phases = {pair: [] for pair in pairs}
    losses = {pair: [] for pair in pairs}
    for i in range(len(seqs)):
        shift = i % len(pairs)
        for pair in pairs[shift:] + pairs[:shift]:
            seconds, loss = step(pair, i)
            if i:  # step 0 is every pair's warm-up
                times[pair].append(sum(seconds))
                phases[pair].append(seconds)
                losses[pair].append(loss)
    # tokens are those of the training data: every side covers the same sequences per step
    slots, ntp = sum(full_slots[1:]), sum(s[0].numel() for s in seqs[1:])
    steps = len(seqs) - 1
    first = args.precision[0]
    rows = {}
    for side, prec in pairs:
        t = times[(side, prec)]
        rows[f"{side}/{prec}"] = {
            "tokens_per_s": slots / sum(t), "ntp_tokens_per_s": ntp / sum(t),
            "median_step_s": statistics.median(t), "step_s_spread": [min(t), max(t)],
            "mean_loss": statistics.mean(losses[(side, prec)]),
            "phase_share": {name: sum(p[j] for p in phases[(side, prec)]) / sum(t) for j, name in enumerate(PHASES)},
        }
    for side, prec in pairs:
        row = rows[f"{side}/{prec}"]
        row["vs_" + first] = row["tokens_per_s"] / rows[f"{side}/{first}"]["tokens_per_s"]
        if side == "gated" and "plain" in args.sides:
            row["gated_over_plain"] = row["tokens_per_s"] / rows[f"plain/{prec}"]["tokens_per_s"]
        if side == "cached" and "gated" in args.sides:
            row["cached_over_gated"] = row["tokens_per_s"] / rows[f"gated/{prec}"]["tokens_per_s"]
    result = {"backbone": args.backbone, "k": args.k, "rank": args.rank, "steps": steps, "anchors": args.anchors,
              "threads": torch.get_num_threads(), "mean_positions_per_step": slots / steps,
              "mean_ntp_tokens_per_step": ntp / steps, "pairs": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    print(f"\n| side/precision | tokens/s | vs {first} | vs gated | median step s (min-max) | "
          + " | ".join(PHASES) + " | mean loss |")
    print("|---|---|---|---|---|" + "---|" * len(PHASES) + "---|")
    for name, r in rows.items():
        lo, hi = r["step_s_spread"]
        gated = rows.get("gated/" + name.split("/")[1])
        vs_gated = f"{r['tokens_per_s'] / gated['tokens_per_s']:.2f}x" if gated else "-"
        shares = " | ".join(f"{r['phase_share'][p]:.0%}" for p in PHASES)
        print(f"| {name} | {r['tokens_per_s']:.0f} | {r['vs_' + first]:.2f}x | {vs_gated} | {r['median_step_s']:.3f} "
              f"({lo:.3f}-{hi:.3f}) | {shares} | {r['mean_loss']:.4f} |")
    print("tokens/s: training-data tokens (NTP + mask slots of the paper's layout) per second; phases: share of "
          "the step's time")
    return result


if __name__ == "__main__":
    run_script(main)
