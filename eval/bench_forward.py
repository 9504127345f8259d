"""Cost of one target forward over T new tokens on a KV cache, per kernel choice, and the
per-machine kernel plan that the bench and the decoder use.

    python eval/bench_forward.py --backbone smollm2-135m-instruct --cache 200 --tokens 1 2 3 5 8 16

First the plan (`mtpkit.models.kernel_plan`): the table it was chosen from (median ms of the
body forward and of the LM head under each kernel, per row count; `*` = chosen), from the
per-machine cache, or measured now if there is none or with --retune (and then cached for the
bench). Then whole forwards (body + LM head over every new row, as a decoding step computes
them), interleaved in one process so that machine drift hits all alike:

  stock   torch's own layers, untouched (what transformers runs)
  onednn  every product on oneDNN's prepacked kernel (row-invariant)
  tuned   the plan: each product on the kernel measured fastest for its row count

Prints median ms and each cost divided by the stock 1-token cost (with the min-max spread over
the timed rounds), and writes it as JSON to --out. A k-token step cheaper than the 1-token step
of the same kernels is named in a WARNING: it means the 1-token path is not the fastest.

With `--head DIR` (a gated-LoRA head), the same forwards of the head's gated copy on torch's own
layers (`gated`), its adapter on for the last third of the new rows (`gated_rows`, as a decoding
step's masks), so the adapter's cost reads off against the plain model's; on a CPU also the copy
as the bench decodes it (`gated_tuned`: packed, on its own plan, the A rows riding along in the
groups' products) and the same copy with its adapter off (`gated_tuned_off`: the floor the bench's
`x rows` divides a gated step by), which split a gated step's excess over `tuned` into the A rows'
share and the gated rows' own products.

On a GPU (`--device cuda`) there is no oneDNN and no plan: the stock forwards and `fused` (the
packed groups `eval/bench.py --linear auto` decodes with there: q/k/v and gate/up as one
`F.linear` each for more than one row, the layers themselves for one) are timed, each after a
device sync; with --head also `gated` (torch's layers) and `gated_fused` (the gated copy packed
the same way, its adapter's A rows in the groups' products).
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
from tqdm import tqdm

from mtpkit.models.backbone import DEFAULT_BACKBONE, DEVICE_CHOICES, load_backbone, resolve_device
from mtpkit.models.atomic_write import write_atomic
from mtpkit.models.process import run_script
from mtpkit.models.kernel_plan import CACHE_LEN, gated_rows, plan_table, tune
from mtpkit.models.packed_linear import cpu_paths, pack_linears

DTYPES = ("float32", "bfloat16")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backbone", default=DEFAULT_BACKBONE, help="target model (default: %(default)s)")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="weights and activations (default: %(default)s)")
    p.add_argument("--cache", type=int, default=CACHE_LEN, help="tokens already in the KV cache (default: %(default)s)")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 5, 8, 16],
                   help="new tokens per forward to time (default: %(default)s)")
    p.add_argument("--reps", type=int, default=9, help="timed rounds; the first 2 are warm-up (default: %(default)s)")
    p.add_argument("--retune", action="store_true",
                   help="measure the kernel plan again (and cache it) even if this machine has one")
    p.add_argument("--out", default="runs/bench_forward.json", help="JSON output (default: %(default)s)")
    p.add_argument("--head", default=None,
                   help="a gated-LoRA head folder (train/export.py): also time its gated copy (`gated`; on a CPU also "
                        "`gated_tuned` and `gated_tuned_off`, packed on its own plan)")
    p.add_argument("--device", default="cpu", metavar=DEVICE_CHOICES,
                   help="where to time: the CPU (packed kernels and their plan too) or a GPU (stock and "
                        "fused forwards, with --head gated ones on both) (default: %(default)s)")
    args = p.parse_args(argv)
    if args.reps < 3 or args.cache < 1 or min(args.tokens) < 1:
        p.error("--reps must be >= 3, --cache and --tokens >= 1")
    if Path(args.out).suffix != ".json":
        p.error(f"--out must end in .json, got {args.out!r}")
    return args


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a GPU's forward returns before it is computed)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def main(argv=None) -> dict:
    args = parse_args(argv)
    try:
        device = resolve_device(args.device)
    except ValueError as e:
        raise SystemExit(f"bench_forward: {e}") from None
    model, _ = load_backbone(args.backbone, dtype=args.dtype, device=device)
    model.eval()
    kinds, layers, record = {"stock": model}, 0, None
    if cpu_paths(device):
        onednn = copy.deepcopy(model)
        layers = pack_linears(onednn, "onednn")
        tuned = copy.deepcopy(onednn)  # deepcopy keeps the groups (and their plans) per copy
        record = tune(tuned, retune=args.retune)
        if record is None and not args.head:
            raise SystemExit(f"bench_forward: {args.backbone} has no linear layer large enough to pack")
        if record is None:
            print(f"{args.backbone} has no linear layer large enough to pack: stock and gated forwards only\n")
        else:
            source = "cached" if record["cached"] else "measured now"
            print(f"kernel plan for {args.backbone} ({args.dtype}) on {record['machine']['cpu']} "
                  f"({record['machine']['threads']} threads), {source} at {record['measured_at']}, "
                  f"load {record['load']}; median ms over {record['reps'] - 1} rounds on a "
                  f"{record['cache_len']}-token cache, * = chosen\n")
            print(plan_table(record) + "\n")
            kinds.update(onednn=onednn, tuned=tuned)
    else:
        fused = copy.deepcopy(model)
        layers = pack_linears(fused, "auto")
        if layers:
            kinds["fused"] = fused
    gates = {}
    if args.head:
        from mtpkit.models.gated_lora import load_head, to_inference

        copies = ["gated"] + (["gated_fused"] if "fused" in kinds else []) + (["gated_tuned"] if "tuned" in kinds else [])
        for kind in copies:
            lean = to_inference(load_head(args.head, copy.deepcopy(model).cpu())).to(device)
            if kind in ("gated_fused", "gated_tuned"):
                pack_linears(lean.peft.get_base_model(), "auto")
            if kind == "gated_tuned":  # the copy's own plan, as the bench decodes it
                tune(kinds["tuned"], [lean.peft.get_base_model()], retune=args.retune)
            kinds[kind], gates[kind] = lean.peft.get_base_model(), lean.gate
        if "gated_tuned" in kinds:  # the same copy with its adapter off: its A rows still in the products
            kinds["gated_tuned_off"] = kinds["gated_tuned"]

    vocab = model.get_input_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, args.cache), generator=gen).to(device)
    cache = model(ids, use_cache=True).past_key_values
    times = {(k, t): [] for k in kinds for t in args.tokens}
    for r in tqdm(range(args.reps), desc="forwards", unit="round"):
        for t in args.tokens:
            x = torch.randint(0, vocab, (1, t), generator=gen).to(device)
            order = list(kinds) if r % 2 == 0 else list(kinds)[::-1]
            for kind in order:
                c = copy.deepcopy(cache)
                on = contextlib.nullcontext()
                if kind in gates:
                    on = gates[kind](torch.arange(t)[None] >= t - gated_rows(t))  # built on the host, as the decoder's
                sync(device)
                t0 = time.perf_counter()
                with on:
                    kinds[kind](x, past_key_values=c, use_cache=True)  # logits of every new row, as a step needs
                sync(device)
                times[(kind, t)].append(time.perf_counter() - t0)
    kept = {key: [1000 * s for s in v[2:]] for key, v in times.items()}
    ms = {k: {t: statistics.median(kept[(k, t)]) for t in args.tokens} for k in kinds}
    spread = {k: {t: [min(kept[(k, t)]), max(kept[(k, t)])] for t in args.tokens} for k in kinds}
    base = ms["stock"][args.tokens[0]]
    where = f"{layers} packed layers" + (f" on {torch.cuda.get_device_name(device)}" if device.type == "cuda" else "")
    lines = [f"{args.backbone} ({args.dtype}), {args.cache}-token cache, {where}; whole forwards, "
             f"median ms over {args.reps - 2} rounds (cost / stock {args.tokens[0]}-token) [min-max ms]", "",
             "| kernels | " + " | ".join(f"{t} tok" for t in args.tokens) + " |", "|---|" + "---|" * len(args.tokens)]
    for kind in kinds:
        lines.append(f"| {kind} | " + " | ".join(
            f"{ms[kind][t]:.1f} ({ms[kind][t] / base:.2f}) [{spread[kind][t][0]:.1f}-{spread[kind][t][1]:.1f}]"
            for t in args.tokens) + " |")
    warnings = []
    if 1 in args.tokens:
        for kind in kinds:
            cheaper = [t for t in args.tokens if t > 1 and ms[kind][t] < ms[kind][1]]
            if cheaper:
                warnings.append(f"WARNING: {kind}: a {cheaper[0]}-token forward ({ms[kind][cheaper[0]]:.1f} ms) is "
                                f"cheaper than the 1-token one ({ms[kind][1]:.1f} ms): the 1-token path is not the "
                                "fastest, so speed-ups over AR on these kernels are inflated")
    print("\n".join(lines + [""] + warnings))
    result = {"backbone": args.backbone, "dtype": args.dtype, "cache": args.cache, "packed_layers": layers,
              "median_ms": ms, "spread_ms": spread,
              "ratio_to_stock_first": {k: {t: v / base for t, v in d.items()} for k, d in ms.items()},
              "device": str(device), "head": args.head,
              "plan": None if record is None else {k: v for k, v in record.items() if k != "cached"},
              "plan_cached": None if record is None else record["cached"],
              "warnings": warnings}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    run_script(main)
