"""The prompts a measurement decodes (eval/bench.py, eval/tree_frontier.py): the flags that choose
them and the loader.

Each `--data` source is a prompt file (.jsonl/.json/.jsonl.gz in any chat format
`mtpkit.data.chat` reads) or a built-in set; every prompt is filed under its record's `category`,
or its file's name when it has none. `--limit N` keeps the first N prompts of each source,
`--skip N` then leaves out the first N of each category (e.g. the ones a bench run measures,
so a tree search calibrates on others) and `--per-category N` keeps at most N of each category
after that. A prompt longer than the model's context leaves room for is skipped, with a warning
naming its source: a cut prompt would lose its chat template's assistant header.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mtpkit.data.chat import load_examples, prompt_ids


def add_prompt_args(parser: argparse.ArgumentParser, data_help: str, default: list[str] | None = None) -> None:
    """--data (`default`; None: required), --limit, --skip and --per-category."""
    parser.add_argument("--data", nargs="+", default=default, required=default is None,
                        help="one or more prompt files (.jsonl/.json/.jsonl.gz in any chat format: Spec-Bench "
                             "`turns`+`category`, HumanEval `prompt`, GSM8K `question`, chat records) or `builtin`; "
                             "a record without `category` is filed under its file's name; " + data_help
                             + ("" if default is None else " (default: %(default)s)"))
    parser.add_argument("--limit", type=int, default=None,
                        help="keep the first N prompts of each --data source (a quick run)")
    parser.add_argument("--skip", type=int, default=0,
                        help="then leave out the first N prompts of each category: to keep a tree search's "
                             "calibration prompts apart from the ones a bench run with --limit N measures")
    parser.add_argument("--per-category", type=int, default=None,
                        help="then keep at most N prompts of each category (a balanced subset)")


def load_prompts(args: argparse.Namespace, tokenizer, max_prompt_len: int | None = None) -> list[dict]:
    """The prompts the flags of `add_prompt_args` select, as {"id", "category", "ids"} (token ids
    of the chat-templated prompt), in source order; those longer than `max_prompt_len` tokens are
    skipped, with a warning per source. Raises DataError for an unreadable source."""
    limit = None if args.limit is None else args.limit + args.skip
    prompts = []
    for source in args.data:
        examples, report = load_examples(source, limit=limit)
        if report.skipped:
            print(f"[prompts] {report.summary()}", file=sys.stderr)
        default = "builtin" if source == "builtin" else Path(source).name.split(".")[0]
        too_long = []
        for ex in examples:
            category = ex.category if ex.category != "default" else default
            ids = prompt_ids(tokenizer, ex.messages)
            if max_prompt_len is not None and len(ids) > max_prompt_len:
                too_long.append(len(ids))
                continue
            prompts.append({"id": f"{default}/{ex.id}", "category": category, "ids": ids})
        if too_long:
            print(f"[prompts] warning: {len(too_long)} of {len(examples)} prompts of {source} are longer than the "
                  f"model's context leaves room for ({max_prompt_len} tokens = max_position_embeddings - "
                  f"--max-new-tokens; longest {max(too_long)}): skipped", file=sys.stderr)
    kept, seen = [], {}
    for p in prompts:
        seen[p["category"]] = seen.get(p["category"], 0) + 1
        if args.skip < seen[p["category"]] <= args.skip + (args.per_category or len(prompts)):
            kept.append(p)
    return kept
