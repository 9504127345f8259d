"""Self-distillation: regenerate the assistant turns of a prompt set with the target backbone.

Heads trained on the target's own outputs accept far more drafts (Medusa-2, SpecForge and
vLLM speculators all do this). Every assistant turn is regenerated in order, each one
conditioned on the target's own earlier replies (`--max-turns` caps the turns kept). The
output is a `.jsonl` of OpenAI-style `messages` records that both training recipes read.

    python data/distill.py --backbone smollm2-135m-instruct --data builtin \
        --out runs/distilled.jsonl --limit 32 --max-new-tokens 128 --batch-size 8

Resumable: re-running appends to `--out` and skips ids already there; a half-written last
line (an interrupted run) is cut off first and its record generated again.

Many processes (`torchrun --nproc_per_node N data/distill.py ...`, `accelerate launch ...`,
one per GPU): prompt i goes to rank i % N (RANK / WORLD_SIZE from the launcher). Each rank
appends its records to its own shard beside `--out` (`OUT.rank{r}-of-{N}.jsonl`, fsynced per
batch) and resumes from it, then writes `OUT.rank{r}-of-{N}.done`; rank 0 waits for every
rank's `.done`, then folds the shards into `--out` (replaced atomically: the records it
already held, then each new id once, in prompt order) and deletes them. No process group is
used: the ranks share only files, so multi-node runs need `--out` on a shared filesystem.
A resume may use another number of processes (or none): the shards of any earlier run count
as done and are merged at the end; only the missing prompts are spread over the new ranks.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from mtpkit.data.chat import DataError, builtin_prompts_path, generation_prompt_ids, load_examples
from mtpkit.data.jsonl import check_output_file, read_jsonl
from mtpkit.models.generate import generate
from mtpkit.models.backbone import (DEFAULT_BACKBONE, BackboneError, add_device_args, eos_token_ids, load_backbone,
                                    resolve_device, resolve_dtype)
from mtpkit.models.atomic_write import write_atomic
from mtpkit.models.process import run_script

POLL_S = 0.25
"""how often rank 0 looks for the other ranks' `.done` files"""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backbone", default=DEFAULT_BACKBONE,
                   help="target model: a known name, a local HF folder or a Hub id (default: %(default)s)")
    p.add_argument("--data", default="builtin",
                   help="prompt file (.jsonl/.json/.jsonl.gz, any chat format), a `datasets` name, or "
                        "`builtin` for mtpkit's own prompt set (default: %(default)s)")
    p.add_argument("--split", default="train", help="split for a `datasets` name (default: %(default)s)")
    p.add_argument("--out", required=True,
                   help="output .jsonl; appended to and resumed if it exists (under a launcher: the merged "
                        "file, with the per-rank shards beside it)")
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
    p.add_argument("--seed", type=int, default=0,
                   help="sampling seed; rank r of a multi-process run uses seed + r (default: %(default)s)")
    add_device_args(p)
    p.add_argument("--wait-timeout", type=float, default=1800.0,
                   help="multi-process runs: rank 0, done with its own shard, gives up (keeping every shard for "
                        "a resume) when the shards it still waits for have not grown for this many seconds "
                        "(default: %(default)s)")
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
    if not args.wait_timeout > 0:
        p.error(f"--wait-timeout must be > 0 seconds, got {args.wait_timeout}")
    try:
        args.device = resolve_device(args.device)
        args.dtype = resolve_dtype(args.dtype, args.device)
        args.rank, args.world_size = launcher_rank()
    except ValueError as e:
        p.error(str(e))
    out = Path(args.out)
    data = builtin_prompts_path() if args.data.startswith("builtin") else Path(args.data).expanduser()
    if out.exists() and data.exists() and os.path.samefile(out, data):
        p.error(f"--out {out} is the --data file; write the records to another file")
    return args


def launcher_rank() -> tuple[int, int]:
    """(RANK, WORLD_SIZE) as torchrun / accelerate launch set them; (0, 1) for a plain process."""
    rank, world = os.environ.get("RANK", "0"), os.environ.get("WORLD_SIZE", "1")
    if not (rank.isdigit() and world.isdigit() and int(rank) < int(world)):
        raise ValueError(f"RANK={rank} WORLD_SIZE={world}: expected 0 <= RANK < WORLD_SIZE from the launcher")
    return int(rank), int(world)


def read_done(out: Path) -> tuple[set[str], int]:
    """Ids already written to `out` (this process's own file). Cuts off a half-written last line;
    counts unreadable lines."""
    lines = read_lines(out, cut_partial=True)
    return {i for i, _ in lines if i is not None}, sum(i is None for i, _ in lines)


def read_lines(path: Path, cut_partial: bool = False) -> list[tuple[str | None, bytes]]:
    """(id, line) for each complete line of `path`, id None where unreadable; a missing file is
    empty. A half-written last line is ignored, or with `cut_partial` cut off the file (only for
    a file no other process may be writing). Lines are mtpkit.data.jsonl's: they end at b"\\n" only
    (a record's text may hold U+2028, which json.dumps(ensure_ascii=False) leaves as it is)."""
    try:
        lines = read_jsonl(path)
    except FileNotFoundError:
        return []
    if lines and not lines[-1].raw.endswith(b"\n"):  # an interrupted write left a partial line: drop it
        lines.pop()
        if cut_partial:
            with open(path, "r+b") as f:
                f.truncate(sum(len(line.raw) for line in lines))
    return [(str(line.value["id"]) if isinstance(line.value, dict) and "id" in line.value else None, line.raw)
            for line in lines]


def shard_path(out: Path, rank: int, world: int, suffix: str = ".jsonl") -> Path:
    """Rank `rank`'s shard beside `out` (`.done` suffix: its completion marker)."""
    return out.with_name(f"{out.stem}.rank{rank}-of-{world}{suffix}")


def shard_files(out: Path) -> tuple[list[Path], list[Path]]:
    """(shards, `.done` markers) beside `out`, of runs with any number of processes."""
    pattern = re.compile(re.escape(out.stem) + r"\.rank\d+-of-\d+(\.jsonl|\.done)")
    found = sorted(p for p in out.parent.iterdir() if pattern.fullmatch(p.name))
    return [p for p in found if p.suffix == ".jsonl"], [p for p in found if p.suffix == ".done"]


def share_fingerprint(examples: list, rank: int, world: int) -> str:
    """What a rank's `.done` file holds: a hash of its share of the prompts (examples[rank::world]).
    A `.done` left by an earlier run counts only for the same share."""
    ids = [ex.id for ex in examples[rank::world]]
    return hashlib.sha256(json.dumps([rank, world, ids]).encode()).hexdigest()


def read_marker(path: Path) -> str | None:
    """The fingerprint in a `.done` file; None when there is none."""
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        return None


def distill(args: argparse.Namespace) -> dict:
    """Run self-distillation on this process's share of the prompts; returns a summary dict (also
    printed). Rank 0 of a multi-process run then waits for the other ranks and merges the shards."""
    rank, world = args.rank, args.world_size
    sharded = world > 1
    # Before any work: the resume check reads --out whole (a device such as /dev/full never ends).
    out = check_output_file(args.out, "--out")
    if sharded:
        check_output_file(shard_path(out, rank, world), "--out (this rank's shard)")
    examples, report = load_examples(args.data, split=args.split, limit=args.limit)
    out.parent.mkdir(parents=True, exist_ok=True)
    share = examples[rank::world]
    target = shard_path(out, rank, world) if sharded else out
    marker = shard_path(out, rank, world, ".done")
    fingerprint = share_fingerprint(examples, rank, world)
    # Checked before reading anything: rank 0 may already be merging (and deleting) a finished shard.
    finished = sharded and read_marker(marker) == fingerprint
    if finished:
        done, bad = {ex.id for ex in share}, 0
    else:
        done, bad = read_done(target)  # this process's own file: a partial last line is cut off
        others = [p for p in shard_files(out)[0] if p != target] + ([out] if sharded else [])
        for path in others:  # read only: another rank may be appending to it
            done |= {i for i, _ in read_lines(path) if i is not None}

    todo = [ex for ex in share if ex.id not in done]
    # similar first-prompt lengths per batch: less padding
    todo.sort(key=lambda ex: sum(len(m["content"]) for m in user_segments(ex.messages)[0]))
    too_long, new_tokens, written, started = 0, 0, 0, time.perf_counter()
    if todo:
        model, tokenizer = load_backbone(args.backbone, dtype=args.dtype, device=args.device,
                                         trust_remote_code=args.trust_remote_code)
        eos_ids = eos_token_ids(model, tokenizer)
        generator = torch.Generator(device=args.device).manual_seed(args.seed + rank)
        started = time.perf_counter()
        bar = tqdm(total=len(todo), desc=f"distill rank {rank}" if sharded else "distill", unit="conversation",
                   position=rank if sharded else None, disable=None)
        with open(target, "a", encoding="utf-8") as f:
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
                    if written < args.show and rank == 0:
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
    summary = {"out": str(target), "written": written, "already_done": len(share) - len(todo),
               "skipped_too_long": too_long, "unreadable_output_lines": bad,
               "skipped_malformed_input": report.skipped, "new_tokens": new_tokens, "seconds": round(seconds, 2),
               "tokens_per_s": round(new_tokens / seconds, 2) if seconds > 0 else 0.0,
               "rank": rank, "world_size": world}
    tag = f"[distill rank {rank}/{world}]" if sharded else "[distill]"
    if rank == 0:
        print(f"{tag} {report.summary()}", file=sys.stderr)
    print(f"{tag} wrote {written} records ({summary['already_done']} already done, {too_long} prompts too long) "
          f"to {target}: {new_tokens} tokens in {seconds:.1f}s = {summary['tokens_per_s']} tok/s",
          file=sys.stderr if sharded else sys.stdout)
    if sharded:
        if not finished:
            write_atomic(marker, fingerprint + "\n")
        if rank != 0:
            return summary
        wait_for_shards(out, examples, world, args.wait_timeout)
    if sharded or any(shard_files(out)):  # a plain run after a multi-process one folds its shards in too
        summary["merged"] = merge_shards(out, examples)
        print(f"[distill] merged the shards into {out}: {summary['merged']} records")
    return summary


def wait_for_shards(out: Path, examples: list, world: int, timeout: float) -> None:
    """Return once every rank's `.done` matches its share; TimeoutError when the shards still
    missing have not changed for `timeout` seconds (a rank died or hangs; the files stay for a resume)."""
    expected = {r: share_fingerprint(examples, r, world) for r in range(world)}
    last_state, last_change = None, time.monotonic()
    while pending := [r for r in range(world) if read_marker(shard_path(out, r, world, ".done")) != expected[r]]:
        shards = [shard_path(out, r, world) for r in pending]
        state = [_size_and_mtime(p) for p in shards]
        if state != last_state:
            last_state, last_change = state, time.monotonic()
        elif time.monotonic() - last_change > timeout:
            raise TimeoutError(f"rank(s) {', '.join(map(str, pending))} of {world} did not finish: "
                               f"{', '.join(p.name for p in shards)} unchanged for --wait-timeout {timeout:g} s; "
                               "the shards are kept, rerun the same command to resume")
        time.sleep(POLL_S)


def _size_and_mtime(path: Path) -> tuple[int, int] | None:
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return stat.st_size, stat.st_mtime_ns


def merge_shards(out: Path, examples: list) -> int:
    """Fold every shard beside `out` (of any number of processes) into `out`, replaced atomically:
    the complete lines it held, then each id it lacks once, in prompt order (ids not among the
    prompts last). Then deletes the `.done` files and the shards. Returns the records in `out`."""
    shards, markers = shard_files(out)
    kept = read_lines(out)
    seen = {i for i, _ in kept if i is not None}
    new = {}
    for path in shards:
        for i, line in read_lines(path):
            if i is not None and i not in seen and i not in new:
                new[i] = line
    order = {ex.id: n for n, ex in enumerate(examples)}
    merged = [line for _, line in kept] + [new[i] for i in sorted(new, key=lambda i: order.get(i, len(order)))]
    write_atomic(out, b"".join(merged))
    for path in markers + shards:  # markers first: a shard without its marker is never taken as complete
        path.unlink(missing_ok=True)
    return len(seen) + len(new)


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
    run_script(main)
