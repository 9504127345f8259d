"""Self-distillation: regenerate the assistant turns of a prompt set with the target backbone.

Heads trained on the target's own outputs accept far more drafts (Medusa-2, SpecForge and
vLLM speculators all do this). The output is a `.jsonl` of OpenAI-style `messages` records
that both training recipes read.

    python data/distill.py --backbone smollm2-135m-instruct --data builtin \
        --out runs/distilled.jsonl --limit 32 --max-new-tokens 128 --batch-size 8

Resumable: re-running appends to `--out` and skips ids already there; a half-written last
line (an interrupted run) is cut off first and its record generated again.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from mtpkit.data.chat import load_examples, prompt_ids
from mtpkit.eval.generate import generate
from mtpkit.models.backbone import DEFAULT_BACKBONE, load_backbone


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backbone", default=DEFAULT_BACKBONE,
                   help="target model: a known name, a local HF folder or a Hub id (default: %(default)s)")
    p.add_argument("--data", default="builtin",
                   help="prompt file (.jsonl/.json/.jsonl.gz, any chat format), a `datasets` name, or "
                        "`builtin` for mtpkit's own prompt set (default: %(default)s)")
    p.add_argument("--split", default="train", help="split for a `datasets` name (default: %(default)s)")
    p.add_argument("--out", required=True, help="output .jsonl; appended to and resumed if it exists")
    p.add_argument("--limit", type=int, default=None, help="use only the first N records of --data")
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens generated per answer (default: %(default)s)")
    p.add_argument("--max-prompt-tokens", type=int, default=1024,
                   help="prompts longer than this are skipped and counted (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy; > 0 samples at this temperature (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass when sampling (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per left-padded batch (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 (default: %(default)s)")
    p.add_argument("--show", type=int, default=0, help="print the first N records written (default: %(default)s)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow custom model code from the Hub/folder")
    args = p.parse_args(argv)
    if args.batch_size < 1 or args.max_new_tokens < 1:
        p.error("--batch-size and --max-new-tokens must be >= 1")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        p.error("--temperature must be >= 0 and --top-p in (0, 1]")
    return args


def read_done(out: Path) -> tuple[set[str], int]:
    """Ids already written to `out`. Cuts off a half-written last line; counts unreadable lines."""
    if not out.exists():
        return set(), 0
    raw = out.read_bytes()
    complete = raw[: raw.rfind(b"\n") + 1]
    if len(complete) != len(raw):  # an interrupted write left a partial line: drop it
        with open(out, "r+b") as f:
            f.truncate(len(complete))
    done, bad = set(), 0
    for line in complete.decode("utf-8", errors="replace").splitlines():
        try:
            done.add(str(json.loads(line)["id"]))
        except (json.JSONDecodeError, KeyError, TypeError):
            bad += 1
    return done, bad


def distill(args: argparse.Namespace) -> dict:
    """Run self-distillation; returns a summary dict (also printed)."""
    examples, report = load_examples(args.data, split=args.split, limit=args.limit)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done, bad = read_done(out)
    model, tokenizer = load_backbone(args.backbone, dtype=args.dtype, trust_remote_code=args.trust_remote_code)
    eos_ids = {tokenizer.eos_token_id} | set(_as_list(model.generation_config.eos_token_id))

    todo, too_long = [], 0
    for ex in examples:
        if ex.id in done:
            continue
        ids = prompt_ids(tokenizer, ex.messages)
        if len(ids) > args.max_prompt_tokens:
            too_long += 1
            continue
        todo.append((ex, ids))
    todo.sort(key=lambda item: len(item[1]))  # similar lengths per batch: less padding
    generator = torch.Generator().manual_seed(args.seed)

    new_tokens, written, started = 0, 0, time.perf_counter()
    bar = tqdm(total=len(todo), desc="distill", unit="prompt", disable=None)
    with open(out, "a", encoding="utf-8") as f:
        for start in range(0, len(todo), args.batch_size):
            batch = todo[start: start + args.batch_size]
            outputs = generate(model, [ids for _, ids in batch], args.max_new_tokens, eos_ids,
                               tokenizer.pad_token_id, args.temperature, args.top_p, generator)
            for (ex, _), gen in zip(batch, outputs):
                finished = bool(gen) and gen[-1] in eos_ids
                text = tokenizer.decode(gen[:-1] if finished else gen)
                prompt_msgs = ex.messages[: next((i for i, m in enumerate(ex.messages) if m["role"] == "assistant"),
                                                 len(ex.messages))]
                record = {"id": ex.id, "category": ex.category,
                          "messages": prompt_msgs + [{"role": "assistant", "content": text}],
                          "backbone": args.backbone, "temperature": args.temperature,
                          "finish_reason": "stop" if finished else "length", "new_tokens": len(gen)}
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
                if written < args.show:
                    tqdm.write(f"--- {ex.id} [{ex.category}]\nuser: {prompt_msgs[-1]['content'][:200]}\n"
                               f"assistant ({len(gen)} tokens): {text[:300]}")
                new_tokens += len(gen)
                written += 1
            f.flush()
            os.fsync(f.fileno())  # a crash after this point loses nothing already generated
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - started):.1f}")
    bar.close()
    seconds = time.perf_counter() - started
    summary = {"out": str(out), "written": written, "already_done": len(done), "skipped_too_long": too_long,
               "unreadable_output_lines": bad, "skipped_malformed_input": report.skipped,
               "new_tokens": new_tokens, "seconds": round(seconds, 2),
               "tokens_per_s": round(new_tokens / seconds, 2) if seconds > 0 else 0.0}
    print(f"[distill] {report.summary()}", file=sys.stderr)
    print(f"[distill] wrote {written} records ({len(done)} already done, {too_long} prompts too long) "
          f"to {out}: {new_tokens} tokens in {seconds:.1f}s = {summary['tokens_per_s']} tok/s")
    return summary


def _as_list(x) -> list:
    return [] if x is None else (list(x) if isinstance(x, (list, tuple)) else [x])


def main(argv=None) -> dict:
    return distill(parse_args(argv))


if __name__ == "__main__":
    main()
