"""Write a prompt mix for self-distillation: GSM8K train questions (math), Code Alpaca
instructions (code) and the first user turn of ShareGPT conversations (chat), prompts only,
shuffled, as `messages` records that `data/distill.py --data` reads (it writes the target's own
answers). The files are the ones docs/medusa.md trains on; point --data-dir at the folder that
holds them.

    python data/mix.py --data-dir DIR --out runs/hydra_best/prompts.jsonl
    python data/distill.py --data runs/hydra_best/prompts.jsonl --out runs/hydra_best/distilled.jsonl ...
    python data/mix.py --data-dir DIR --eval 3 --out runs/hydra_best/eval.jsonl   # held-out test prompts

Train mix (default): the first --math records of gsm8k_train.jsonl (`question`), the first
--code of code_alpaca_2k.jsonl (`instruction`, then `input` after a blank line when there is
one) and the first user turn of the last --chat records of sharegpt_1k.jsonl (`conversations`,
`from` human) that has a reply; prompts longer than --max-prompt-chars are left out (their
answers would not fit a short training window), then the mix is shuffled (--seed). --answers keeps
the files' own answers as the assistant turns (other models' answers). Ids name
the source and its line (`gsm8k-train-12`, `code-alpaca-3`, `sharegpt-<id>`), categories are
math, code and chat.

--eval N instead writes the first N prompts of humaneval.jsonl.gz (category humaneval) and of
gsm8k_test.jsonl (category gsm8k_test), alternating, for the trainers' --eval-data (the prompts
the benches of docs/medusa.md measure with --limit N, none of them in the train mix).
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
from pathlib import Path

from mtpkit.models.process import run_script

FILES = {"math": "gsm8k_train.jsonl", "code": "code_alpaca_2k.jsonl", "chat": "sharegpt_1k.jsonl"}
EVAL_FILES = {"humaneval": "humaneval.jsonl.gz", "gsm8k_test": "gsm8k_test.jsonl"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", required=True,
                   help="folder holding " + ", ".join(list(FILES.values()) + list(EVAL_FILES.values())))
    p.add_argument("--out", required=True, help="output .jsonl of prompt-only messages records (replaced)")
    p.add_argument("--math", type=int, default=350, help="GSM8K train questions, the first N (default: %(default)s)")
    p.add_argument("--code", type=int, default=350,
                   help="Code Alpaca instructions, the first N (default: %(default)s)")
    p.add_argument("--chat", type=int, default=300,
                   help="ShareGPT conversations, the last N (their first user turn; default: %(default)s)")
    p.add_argument("--max-prompt-chars", type=int, default=1500,
                   help="leave out prompts longer than this many characters (0 = keep all; default: %(default)s)")
    p.add_argument("--answers", action="store_true",
                   help="keep each source's own answer as the assistant turn (other models' answers, Medusa-1's "
                        "setting) instead of prompts only (for data/distill.py)")
    p.add_argument("--seed", type=int, default=0, help="seed of the shuffle (default: %(default)s)")
    p.add_argument("--exclude", nargs="+", default=[], metavar="JSONL",
                   help="leave out, after the shuffle, every prompt whose id is in these .jsonl files (e.g. a "
                        "distilled set, to write only prompts it does not have yet)")
    p.add_argument("--eval", type=int, default=0, metavar="N",
                   help="write the first N HumanEval and N GSM8K test prompts instead of the train mix "
                        "(default: %(default)s = the train mix)")
    args = p.parse_args(argv)
    for flag in ("math", "code", "chat", "max_prompt_chars", "eval"):
        if getattr(args, flag) < 0:
            p.error(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag)}")
    return args


def read_rows(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def record(prompt: str, category: str, id_: str, answer: str | None = None) -> dict:
    messages = [{"role": "user", "content": prompt}] + ([{"role": "assistant", "content": answer}] if answer is not None else [])
    return {"id": id_, "category": category, "messages": messages}


def train_mix(data_dir: Path, args: argparse.Namespace) -> list[dict]:
    rows = {c: read_rows(data_dir / f) for c, f in FILES.items()}
    keep = args.answers
    out = [record(r["question"], "math", f"gsm8k-train-{i}", r["answer"] if keep else None)
           for i, r in enumerate(rows["math"][: args.math])]
    out += [record(r["instruction"] + ("\n\n" + r["input"] if r.get("input") else ""), "code", f"code-alpaca-{i}",
                   r["output"] if keep else None) for i, r in enumerate(rows["code"][: args.code])]
    for r in rows["chat"][len(rows["chat"]) - args.chat:] if args.chat else []:
        turns = r["conversations"]
        pair = next(((a, b) for a, b in zip(turns, turns[1:]) if a["from"] == "human" and b["from"] == "gpt"), None)
        if pair is not None:
            out.append(record(pair[0]["value"], "chat", "sharegpt-" + str(r["id"]), pair[1]["value"] if keep else None))
    if args.max_prompt_chars:
        out = [r for r in out if len(r["messages"][0]["content"]) <= args.max_prompt_chars]
    random.Random(args.seed).shuffle(out)
    return out


def eval_prompts(data_dir: Path, n: int) -> list[dict]:
    he = read_rows(data_dir / EVAL_FILES["humaneval"])[:n]
    gsm = read_rows(data_dir / EVAL_FILES["gsm8k_test"])[:n]
    out = []
    for a, b in zip(he, gsm):
        out += [record(a["prompt"], "humaneval", a["task_id"]), record(b["question"], "gsm8k_test", f"gsm8k-test-{len(out) // 2}")]
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    data_dir = Path(args.data_dir).expanduser()
    try:
        records = eval_prompts(data_dir, args.eval) if args.eval else train_mix(data_dir, args)
    except (OSError, KeyError, ValueError) as e:
        print(f"error: {data_dir}: {e}", file=sys.stderr)
        return 2
    excluded = set()
    for path in args.exclude:
        try:
            excluded |= {json.loads(line)["id"] for line in Path(path).read_text(encoding="utf-8").splitlines()
                         if line.strip()}
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"error: --exclude {path}: {e}", file=sys.stderr)
            return 2
    records = [r for r in records if r["id"] not in excluded]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    counts = {}
    for r in records:
        counts[r["category"]] = counts.get(r["category"], 0) + 1
    print(f"[mix] {len(records)} prompts -> {out} ({', '.join(f'{c} {n}' for c, n in counts.items())})")
    return 0


if __name__ == "__main__":
    run_script(main, exit_status=True)
