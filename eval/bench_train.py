"""Training throughput: gated-LoRA MTP steps against plain LoRA fine-tuning of the same backbone.

    python eval/bench_train.py --backbone smollm2-135m-instruct --data runs/distilled.jsonl --k 4 --steps 6

Both sides run full optimizer steps (forward, backward, AdamW) with the same LoRA rank and
target modules, on inputs of the SAME total length: a gated-LoRA sequence of n tokens becomes
T = n + k * (loss tokens) Figure-4 slots; plain LoRA trains causal-LM on T real tokens. The two
alternate step by step after a warm-up, so machine drift hits both alike. Reports tokens/s
(input positions per second), the ratio gated / plain, and the gated side's cost per NTP token.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch

from mtpkit.data.chat import IGNORE, load_examples, tokenize_chat
from mtpkit.data.mtp import collate_mask_inputs, mask_inputs
from mtpkit.models.backbone import DEFAULT_BACKBONE, load_backbone
from mtpkit.models.gated_lora import GatedLoRAConfig, GatedMTP
from mtpkit.models.heads import write_atomic


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backbone", default=DEFAULT_BACKBONE, help="model name or folder (default: %(default)s)")
    p.add_argument("--data", default="builtin", help="chat data to take sequences from (default: %(default)s)")
    p.add_argument("--k", type=int, default=4, help="mask tokens (default: %(default)s)")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank on both sides (default: %(default)s)")
    p.add_argument("--max-length", type=int, default=256, help="tokens per gated sequence before masks (default: %(default)s)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per side after 1 warm-up (default: %(default)s)")
    p.add_argument("--out", default="runs/bench_train.json", help="results JSON (default: %(default)s)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    from peft import LoraConfig, get_peft_model

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

    cfg = GatedLoRAConfig(k=args.k, rank=args.rank)
    gated = GatedMTP(copy.deepcopy(base), cfg).train()
    plain = get_peft_model(copy.deepcopy(base), LoraConfig(r=args.rank, lora_alpha=cfg.alpha,
                                                           target_modules=list(cfg.target_modules))).train()
    opts = {name: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-5)
            for name, m in (("gated", gated), ("plain", plain))}
    all_ids = torch.cat([s[0] for s in seqs])

    def gated_step(i):
        batch = collate_mask_inputs([mask_inputs(*seqs[i], args.k)])
        gated(**batch)["loss"].backward()
        opts["gated"].step()
        opts["gated"].zero_grad()
        return batch["input_ids"].numel(), seqs[i][0].numel()

    def plain_step(i, length):
        ids = all_ids.roll(-i * 97)[:length][None]  # real tokens, as many as the gated step's slots
        plain(input_ids=ids, labels=ids).loss.backward()
        opts["plain"].step()
        opts["plain"].zero_grad()
        return length

    times = {"gated": [], "plain": []}
    slots = ntp = 0
    for i in range(len(seqs)):
        t0 = time.perf_counter()
        T, n = gated_step(i)
        dt_gated = time.perf_counter() - t0
        t0 = time.perf_counter()
        plain_step(i, T)
        dt_plain = time.perf_counter() - t0
        if i == 0:
            continue  # warm-up
        times["gated"].append(dt_gated)
        times["plain"].append(dt_plain)
        slots, ntp = slots + T, ntp + n
    result = {
        "backbone": args.backbone, "k": args.k, "rank": args.rank, "steps": len(times["gated"]),
        "mean_positions_per_step": slots / len(times["gated"]), "mean_ntp_tokens_per_step": ntp / len(times["gated"]),
        "gated_tokens_per_s": slots / sum(times["gated"]), "plain_lora_tokens_per_s": slots / sum(times["plain"]),
        "gated_ntp_tokens_per_s": ntp / sum(times["gated"]),
        "median_step_s": {k: statistics.median(v) for k, v in times.items()},
    }
    result["ratio_gated_over_plain"] = result["gated_tokens_per_s"] / result["plain_lora_tokens_per_s"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
