"""What this machine allows a decoder: the host costs a decoding step pays, and the floor every
decoding speed is measured against.

    python eval/device_probe.py --backbone smollm2-135m-instruct --out runs/probe/device.json
    python eval/device_probe.py --device cuda --compile 1 --out runs/probe/device_gpu.json

Measured on the current device (median over --repeats, each with its min-max spread):

  op_us            one tiny op (an in-place add on one element): a kernel launch on a GPU, an op
                   dispatch on a CPU; what an eager step pays per op
  ops_per_step     aten ops in one eager 1-token forward of the backbone on a KV cache
  copy_GBps        a large device-to-device copy: the memory bandwidth a step's weight reads see
  sync_us, item_us, h2d_pageable_us, h2d_pinned_us, graph_replay_us (CUDA only): a device sync,
                   a `.item()` read after a tiny op, a 64-element host-to-device copy from pageable
                   and from pinned memory (non-blocking), and the replay of a captured CUDA graph of
                   1,000 tiny ops, per op
  hf_eager_ms, hf_static_compiled_ms, compile_s: transformers' `generate`, greedy, decode ms a
                   token (prefill excluded: the time of --tokens new tokens less that of one, over
                   --tokens - 1), with its dynamic cache, eager; and with its static cache and the
                   forward under torch.compile (`cache_implementation="static"` and a compile_config:
                   what a transformers user's fastest path is), the first call's compile seconds
                   apart (--compile 0 skips it)

and from them the floors of a 1-token step (ms): `memory_floor_ms` = the backbone's weight bytes /
copy_GBps (a step reads every weight once), `dispatch_floor_ms` = ops_per_step x op_us (an eager
step's host cost alone), on CUDA `graph_floor_ms` = ops_per_step x graph_replay_us + item_us (one
graph replay and one host read); `floor_ms` is the larger of the memory floor and the step's
host floor (the graph floor on CUDA, the dispatch floor on a CPU), and `bound` names which.
Writes the JSON to --out and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache

from mtpkit.models.backbone import DEFAULT_BACKBONE, add_device_args, load_backbone, resolve_device, resolve_dtype
from mtpkit.models.atomic_write import write_atomic
from mtpkit.models.generate import hf_static_compiled
from mtpkit.models.process import run_script


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backbone", default=DEFAULT_BACKBONE, help="the model whose step is probed (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=32,
                   help="new tokens per timed transformers generate (>= 2; default: %(default)s)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs of each measurement (default: %(default)s)")
    p.add_argument("--compile", type=int, choices=(0, 1), default=1,
                   help="also time transformers' static cache + torch.compile (compiles the model: a minute or "
                        "more on a CPU; default: %(default)s)")
    p.add_argument("--out", default="runs/probe/device.json", help="the results JSON (default: %(default)s)")
    add_device_args(p)
    args = p.parse_args(argv)
    if args.tokens < 2 or args.repeats < 1:
        p.error("--tokens must be >= 2 and --repeats >= 1")
    return args


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, repeats: int, device: torch.device, per: int = 1) -> dict:
    """{median, min, max} seconds of `fn()` over `repeats` timed runs (after one warm-up), each
    divided by `per` (the operations one run does)."""
    fn()
    sync(device)
    runs = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        runs.append((time.perf_counter() - t0) / per)
    return {"median": statistics.median(runs), "min": min(runs), "max": max(runs)}


def scaled(t: dict, factor: float) -> dict:
    return {k: v * factor for k, v in t.items()}


class CountOps(TorchDispatchMode):
    """Counts the aten ops dispatched while active."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


@torch.no_grad()
def ops_per_step(model, device: torch.device) -> int:
    """aten ops of one eager 1-token forward after a 16-token prefill on a DynamicCache."""
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.arange(1, 17, device=device)[None], past_key_values=cache, use_cache=True)
    with CountOps() as counter:
        model(input_ids=torch.tensor([[5]], device=device), past_key_values=cache, use_cache=True)
    return counter.count


def host_costs(device: torch.device, repeats: int) -> dict:
    """The per-op and transfer costs (microseconds), CUDA-only ones where the device is CUDA."""
    one = torch.zeros(1, device=device)
    n = 1000

    def ops():
        for _ in range(n):
            one.add_(0)

    out = {"op_us": scaled(timed(ops, repeats, device, per=n), 1e6)}
    big = torch.empty(64 * 2**20, dtype=torch.uint8, device=device)  # 64 MiB
    dst = torch.empty_like(big)
    copy = timed(lambda: dst.copy_(big), repeats, device)

    def gbps(seconds):  # bytes read and written
        return 2 * big.numel() / seconds / 1e9
    out["copy_GBps"] = {"median": gbps(copy["median"]), "min": gbps(copy["max"]), "max": gbps(copy["min"])}
    if device.type != "cuda":
        return out
    out["sync_us"] = scaled(timed(lambda: torch.cuda.synchronize(device), repeats * 20, device), 1e6)
    out["item_us"] = scaled(timed(lambda: one.add_(0).item(), repeats * 20, device), 1e6)
    small = torch.arange(64)
    pinned = small.pin_memory()
    out["h2d_pageable_us"] = scaled(timed(lambda: small.to(device), repeats * 20, device), 1e6)
    out["h2d_pinned_us"] = scaled(timed(lambda: pinned.to(device, non_blocking=True), repeats * 20, device), 1e6)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        ops()  # warm-up on the side stream, as capture requires
    torch.cuda.current_stream(device).wait_stream(stream)
    with torch.cuda.graph(graph):
        ops()
    out["graph_replay_us"] = scaled(timed(graph.replay, repeats, device, per=n), 1e6)
    return out


def hf_decode_ms(model, tokenizer, device: torch.device, tokens: int, repeats: int, **generate_kwargs) -> dict:
    """transformers' greedy generate, ms a new token with prefill excluded: (t(tokens) - t(1)) / (tokens - 1)."""
    ids = tokenizer("Write a short story about a robot who learns to paint.", return_tensors="pt").input_ids.to(device)

    def run(n):
        return lambda: model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                      do_sample=False, pad_token_id=tokenizer.pad_token_id, **generate_kwargs)

    many, one = timed(run(tokens), repeats, device), timed(run(1), repeats, device)
    return {k: (many[k] - one["median"]) / (tokens - 1) * 1e3 for k in many}


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = resolve_device(args.device)
    model, tokenizer = load_backbone(args.backbone, dtype=resolve_dtype(args.dtype, device), device=device)
    results = {"backbone": args.backbone, "device": str(device), "dtype": str(model.dtype).removeprefix("torch."),
               "torch": torch.__version__, "threads": torch.get_num_threads()}
    if device.type == "cuda":
        results["device_name"] = torch.cuda.get_device_name(device)
    results.update(host_costs(device, args.repeats))
    results["ops_per_step"] = ops_per_step(model, device)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    results["weight_MB"] = weight_bytes / 1e6
    results["hf_eager_ms"] = hf_decode_ms(model, tokenizer, device, args.tokens, args.repeats, disable_compile=True)
    if args.compile:
        kwargs = hf_static_compiled(device)
        t0 = time.perf_counter()
        hf_decode_ms(model, tokenizer, device, 2, 1, **kwargs)  # the first calls compile (1 and 2 tokens)
        results["compile_s"] = time.perf_counter() - t0
        results["hf_static_compiled_ms"] = hf_decode_ms(model, tokenizer, device, args.tokens, args.repeats, **kwargs)
    floors = {"memory_floor_ms": weight_bytes / (results["copy_GBps"]["median"] * 1e9) * 1e3,
              "dispatch_floor_ms": results["ops_per_step"] * results["op_us"]["median"] / 1e3}
    if device.type == "cuda":
        floors["graph_floor_ms"] = (results["ops_per_step"] * results["graph_replay_us"]["median"]
                                    + results["item_us"]["median"]) / 1e3
    host = floors.get("graph_floor_ms", floors["dispatch_floor_ms"])
    floors["floor_ms"] = max(floors["memory_floor_ms"], host)
    floors["bound"] = "memory" if floors["memory_floor_ms"] >= host else "host"
    results.update(floors)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, json.dumps(results, indent=1))
    print(table(results))
    print(f"[device_probe] wrote {out}")
    return results


def table(results: dict) -> str:
    """The results as a markdown table (medians, with the spread)."""
    lines = [f"{results['backbone']} on {results.get('device_name', results['device'])} ({results['dtype']}, "
             f"torch {results['torch']}, {results['threads']} threads)", "", "| measure | median | min-max |",
             "|---|---|---|"]
    for key, value in results.items():
        if isinstance(value, dict):
            lines.append(f"| {key} | {value['median']:.3f} | {value['min']:.3f}-{value['max']:.3f} |")
        elif isinstance(value, float) or key in ("ops_per_step", "bound"):
            lines.append(f"| {key} | {value if isinstance(value, (int, str)) else f'{value:.3f}'} | |")
    return "\n".join(lines)


if __name__ == "__main__":
    run_script(main)
