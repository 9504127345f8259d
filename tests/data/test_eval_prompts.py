"""The prompt selection eval/bench.py and eval/tree_frontier.py share: --limit per source, then
--skip and --per-category per category, a record without a category filed under its file's name."""

import argparse
import json

from mtpkit.data.eval_prompts import add_prompt_args, load_prompts


def test_limit_skip_and_per_category_select_the_same_prompts_for_every_tool(tiny, tmp_path):
    _, tokenizer = tiny
    data = tmp_path / "mixed.jsonl"
    records = [{"id": i, "turns": [f"question {i}?"], **({"category": "a"} if i % 2 else {})} for i in range(8)]
    data.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    p = argparse.ArgumentParser()
    add_prompt_args(p, "each category a row", default=["builtin"])

    def ids(argv):
        return [q["id"] for q in load_prompts(p.parse_args(["--data", str(data), *argv]), tokenizer)]

    assert ids([]) == [f"mixed/{i}" for i in range(8)]
    assert ids(["--limit", "5"]) == [f"mixed/{i}" for i in range(5)]
    # per category ("mixed" for the records without one, "a"): the first one left out, then one kept
    assert ids(["--skip", "1", "--per-category", "1"]) == ["mixed/2", "mixed/3"]
    # --limit counts the skipped prompts on top: the same prompts are measured after them
    assert ids(["--limit", "4", "--skip", "1"]) == ["mixed/2", "mixed/3", "mixed/4"]
    prompts = load_prompts(p.parse_args(["--data", str(data)]), tokenizer)
    assert {q["category"] for q in prompts} == {"mixed", "a"} and all(q["ids"] for q in prompts)
