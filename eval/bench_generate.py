"""Benchmark plain generation: cached-backbone load time, batched vs one-at-a-time tokens/s,
and greedy agreement with transformers' `generate(do_sample=False)`.

    python eval/bench_generate.py --backbone smollm2-135m-instruct --data builtin --limit 32 \
        --max-new-tokens 64 --batch-size 8

The two generation modes alternate chunk by chunk (B prompts one at a time, then the same B
prompts as one batch) so that machine drift hits both equally. `--device` / `--dtype` place the
model (auto: CUDA in bfloat16 when present, else the CPU in float32); the cold load is timed
with the same flags.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

from mtpkit.data.chat import load_examples, prompt_ids
from mtpkit.models.generate import generate
from mtpkit.models.backbone import DEFAULT_BACKBONE, add_device_args, load_backbone, resolve_device, resolve_dtype
from mtpkit.models.process import run_script


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backbone", default=DEFAULT_BACKBONE, help="target model (default: %(default)s)")
    p.add_argument("--data", default="builtin", help="prompt file or `builtin` (default: %(default)s)")
    p.add_argument("--limit", type=int, default=32, help="number of prompts (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens per prompt (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=8, help="batch size of the batched mode (default: %(default)s)")
    p.add_argument("--hf-check", type=int, default=4,
                   help="compare this many greedy outputs with HF generate() (default: %(default)s)")
    p.add_argument("--out", default=None, help="write the numbers as JSON here")
    add_device_args(p)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    try:
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
    except ValueError as e:
        sys.exit(f"bench_generate: {e}")
    model, tokenizer = load_backbone(args.backbone, dtype=dtype, device=device)  # builds the cache if needed
    # a cold process, imports included: what a user waits for
    dtype_name = str(dtype).removeprefix("torch.")
    code = ("import time; t = time.perf_counter(); from mtpkit.models.backbone import load_backbone; "
            f"load_backbone({args.backbone!r}, dtype={dtype_name!r}, device={str(device)!r}); "
            "print(time.perf_counter() - t)")
    load_s = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                  check=True).stdout.split()[-1])
    examples, _ = load_examples(args.data, limit=args.limit)
    prompts = sorted((prompt_ids(tokenizer, ex.messages) for ex in examples), key=len)
    eos, pad = [tokenizer.eos_token_id], tokenizer.pad_token_id

    single_s = batched_s = 0.0
    single_tokens = batched_tokens = same = 0
    single_out = []
    for start in range(0, len(prompts), args.batch_size):
        chunk = prompts[start: start + args.batch_size]
        t = time.perf_counter()
        one = [generate(model, [p], args.max_new_tokens, eos, pad)[0] for p in chunk]
        single_s += time.perf_counter() - t
        t = time.perf_counter()
        many = generate(model, chunk, args.max_new_tokens, eos, pad)
        batched_s += time.perf_counter() - t
        single_tokens += sum(map(len, one))
        batched_tokens += sum(map(len, many))
        same += sum(a == b for a, b in zip(one, many))
        single_out += one
        print(f"  {start + len(chunk)}/{len(prompts)} prompts: one-at-a-time {single_tokens / single_s:.1f} tok/s, "
              f"batched {batched_tokens / batched_s:.1f} tok/s", flush=True)

    hf_same = 0
    for p, mine in zip(prompts[: args.hf_check], single_out):
        ref = model.generate(torch.tensor([p], device=device),
                             attention_mask=torch.ones(1, len(p), dtype=torch.long, device=device),
                             do_sample=False, max_new_tokens=args.max_new_tokens, eos_token_id=eos,
                             pad_token_id=pad)[0, len(p):].tolist()
        hf_same += ref == mine
    result = {
        "backbone": args.backbone, "device": str(device), "dtype": dtype_name, "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "batch_size": args.batch_size, "cold_load_from_cache_s": round(load_s, 2),
        "one_at_a_time_tokens_per_s": round(single_tokens / single_s, 2),
        "batched_tokens_per_s": round(batched_tokens / batched_s, 2),
        "batched_over_one_at_a_time": round((batched_tokens / batched_s) / (single_tokens / single_s), 2),
        "batched_equals_one_at_a_time": f"{same}/{len(prompts)}",
        "greedy_equals_hf_generate": f"{hf_same}/{min(args.hf_check, len(prompts))}",
    }
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    run_script(main)
