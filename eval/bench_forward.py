"""Cost of one target forward over T new tokens on a KV cache, torch's stock kernels against
the packed ones (`mtpkit.models.packed_linear`), the two interleaved in one process so that
machine drift hits both alike. Verification cost per step is what decides whether a drafter's
tau turns into wall-clock speed-up.

    python eval/bench_forward.py --backbone smollm2-135m-instruct --cache 200 --tokens 1 2 3 5 8 16

Prints a table of median milliseconds and of each cost divided by the stock 1-token cost, and
writes it as JSON to --out.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from mtpkit.models.backbone import DEFAULT_BACKBONE, load_backbone
from mtpkit.models.heads import write_atomic
from mtpkit.models.packed_linear import pack_linears


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backbone", default=DEFAULT_BACKBONE, help="target model (default: %(default)s)")
    p.add_argument("--cache", type=int, default=200, help="tokens already in the KV cache (default: %(default)s)")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 5, 8, 16],
                   help="new tokens per forward to time (default: %(default)s)")
    p.add_argument("--reps", type=int, default=9, help="timed rounds; the first 2 are warm-up (default: %(default)s)")
    p.add_argument("--out", default="runs/bench_forward.json", help="JSON output (default: %(default)s)")
    args = p.parse_args(argv)
    if args.reps < 3 or args.cache < 1 or min(args.tokens) < 1:
        p.error("--reps must be >= 3, --cache and --tokens >= 1")
    return args


@torch.no_grad()
def main(argv=None) -> dict:
    args = parse_args(argv)
    model, _ = load_backbone(args.backbone)
    model.eval()
    packed = copy.deepcopy(model)
    layers = pack_linears(packed, "onednn")
    vocab = model.get_input_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(0)
    cache = model(torch.randint(0, vocab, (1, args.cache), generator=gen), use_cache=True).past_key_values
    kinds = {"stock": model, "packed": packed}
    times = {(k, t): [] for k in kinds for t in args.tokens}
    for _ in tqdm(range(args.reps), desc="forwards", unit="round"):
        for t in args.tokens:
            x = torch.randint(0, vocab, (1, t), generator=gen)
            for kind, m in kinds.items():
                c = copy.deepcopy(cache)
                t0 = time.perf_counter()
                m(x, past_key_values=c, use_cache=True, logits_to_keep=1)
                times[(kind, t)].append(time.perf_counter() - t0)
    ms = {k: {t: 1000 * statistics.median(times[(k, t)][2:]) for t in args.tokens} for k in kinds}
    base = ms["stock"][args.tokens[0]]
    lines = [f"{args.backbone}, {args.cache}-token cache, {layers} packed layers; median ms (cost / stock "
             f"{args.tokens[0]}-token)", "", "| kernels | " + " | ".join(f"{t} tok" for t in args.tokens) + " |",
             "|---|" + "---|" * len(args.tokens)]
    for kind in kinds:
        lines.append(f"| {kind} | " + " | ".join(f"{ms[kind][t]:.1f} ({ms[kind][t] / base:.2f})" for t in args.tokens)
                     + " |")
    print("\n".join(lines))
    result = {"backbone": args.backbone, "cache": args.cache, "packed_layers": layers, "median_ms": ms,
              "ratio_to_stock_first": {k: {t: v / base for t, v in d.items()} for k, d in ms.items()}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
