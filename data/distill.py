"""Self-distillation: regenerate the assistant turns of a prompt set with the target backbone.

Heads trained on the target's own outputs accept far more drafts (Medusa-2, SpecForge and
vLLM speculators all do this). Every assistant turn is regenerated in order, each one
conditioned on the target's own earlier replies (`--max-turns` caps the turns kept). The
output is a `.jsonl` of OpenAI-style `messages` records that both training recipes read.

    python data/distill.py --backbone smollm2-135m-instruct --data builtin \
        --out runs/distilled.jsonl --limit 32 --max-new-tokens 128 --batch-size 8

Resumable: re-running appends to `--out` and skips ids already there; a half-written last
line (an interrupted run) is cut off first and its record generated again.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from mtpkit.data.chat import DataError, builtin_prompts_path, generation_prompt_ids, load_examples
from mtpkit.models.generate import generate
from mtpkit.models.backbone import DEFAULT_BACKBONE, DTYPES, BackboneError, eos_token_ids, load_backbone


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
                   help="a turn whose prompt is longer than this ends its conversation there; a record whose "
                        "first prompt is too long is skipped and counted (default: %(default)s)")
    p.add_argument("--max-turns", type=int, default=None,
                   help="regenerate at most N assistant turns per conversation (default: all)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy; > 0 samples at this temperature (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass when sampling (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per left-padded batch (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="weight dtype (default: %(default)s)")
    p.add_argument("--show", type=int, default=0, help="print the first N records written (default: %(default)s)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow custom model code from the Hub/folder")
    args = p.parse_args(argv)
    for flag, ok in (("--limit", args.limit is None or args.limit >= 1),
                     ("--max-new-tokens", args.max_new_tokens >= 1),
                     ("--max-prompt-tokens", args.max_prompt_tokens >= 1),
                     ("--max-turns", args.max_turns is None or args.max_turns >= 1),
                     ("--batch-size", args.batch_size >= 1)):
        if not ok:
            p.error(f"{flag} must be >= 1, got {getattr(args, flag[2:].replace('-', '_'))}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        p.error(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        p.error(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.show < 0:
        p.error(f"--show must be >= 0, got {args.show}")
    out = Path(args.out)
    data = builtin_prompts_path() if args.data.startswith("builtin") else Path(args.data).expanduser()
    if out.is_dir():
        p.error(f"--out {out} is a folder; give the .jsonl file to write")
    if out.exists() and data.exists() and os.path.samefile(out, data):
        p.error(f"--out {out} is the --data file; write the records to another file")
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
    eos_ids = eos_token_ids(model, tokenizer)

    todo = [ex for ex in examples if ex.id not in done]
    # similar first-prompt lengths per batch: less padding
    todo.sort(key=lambda ex: sum(len(m["content"]) for m in user_segments(ex.messages)[0]))
    too_long = 0
    generator = torch.Generator().manual_seed(args.seed)

    new_tokens, written, started = 0, 0, time.perf_counter()
    bar = tqdm(total=len(todo), desc="distill", unit="conversation", disable=None)
    with open(out, "a", encoding="utf-8") as f:
        for start in range(0, len(todo), args.batch_size):
            batch = todo[start: start + args.batch_size]
            convs = regenerate(model, tokenizer, [ex.messages for ex in batch], args, eos_ids, generator)
            for ex, (messages, n_tokens, finish) in zip(batch, convs):
                if not any(m["role"] == "assistant" for m in messages):  # first prompt over the limit
                    too_long += 1
                    continue
                record = {"id": ex.id, "category": ex.category, "messages": messages, "backbone": args.backbone,
                          "temperature": args.temperature, "finish_reason": finish, "new_tokens": n_tokens}
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
                if written < args.show:
                    user = next(m["content"] for m in messages if m["role"] == "user")
                    reply = next(m["content"] for m in messages if m["role"] == "assistant")
                    tqdm.write(f"--- {ex.id} [{ex.category}]\nuser: {user[:200]}\nassistant: {reply[:300]}")
                new_tokens += n_tokens
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


def user_segments(messages: list[dict]) -> list[list[dict]]:
    """The non-assistant messages before each assistant reply: [[system, user 1], [user 2], ...]."""
    segments, current = [], []
    for message in messages:
        if message["role"] != "assistant":
            current.append(message)
        elif current:
            segments.append(current)
            current = []
    return segments + ([current] if current else [])


def regenerate(model, tokenizer, conversations: list[list[dict]], args, eos_ids: set[int],
               generator: torch.Generator) -> list[tuple[list[dict], int, str]]:
    """Replace every assistant turn with the target's own reply, turn by turn, batched across
    conversations. Returns (messages, new tokens, finish reason of the last turn) per conversation."""
    segments = [user_segments(c)[: args.max_turns] for c in conversations]
    history = [[] for _ in conversations]
    tokens = [0] * len(conversations)
    finish = ["length"] * len(conversations)
    ended = [False] * len(conversations)
    for turn in range(max(len(s) for s in segments)):
        active, prompts = [], []
        for b, segs in enumerate(segments):
            if turn < len(segs) and not ended[b]:
                ids = generation_prompt_ids(tokenizer, history[b] + segs[turn])
                if len(ids) > args.max_prompt_tokens:  # the conversation ends with the turns done so far
                    ended[b] = True
                    continue
                active.append(b)
                prompts.append(ids)
        if not active:
            break
        outputs = generate(model, prompts, args.max_new_tokens, eos_ids, tokenizer.pad_token_id,
                           args.temperature, args.top_p, generator)
        for b, gen in zip(active, outputs):
            stopped = bool(gen) and gen[-1] in eos_ids
            reply = tokenizer.decode(gen[:-1] if stopped else gen)
            history[b] += segments[b][turn] + [{"role": "assistant", "content": reply}]
            tokens[b] += len(gen)
            finish[b] = "stop" if stopped else "length"
    return list(zip(history, tokens, finish))



def main(argv=None) -> dict:
    """A user's mistake (unreadable --data, unknown backbone, unwritable --out) is one line
    `error: ...` and exit status 2, as for a bad flag."""
    args = parse_args(argv)
    try:
        return distill(args)
    except (DataError, BackboneError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
