"""The built-in prompt sets: builtin.jsonl (builtin, builtin:eval, the start of builtin:train) and
train.jsonl (the rest of builtin:train)."""

import json
from collections import Counter

from mtpkit.data.chat import (BUILTIN_EVAL_PER_CATEGORY, builtin_prompts_path, builtin_train_prompts_path,
                              load_examples)

TRAIN_COUNTS = {"code": 140, "math": 140, "chat": 70, "summarisation": 50}


def _records(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _prompt(example):
    return example.messages[0]["content"]


def test_builtin_train_is_builtin_non_eval_then_train_jsonl():
    builtin, extra = _records(builtin_prompts_path()), _records(builtin_train_prompts_path())
    seen = Counter()
    non_eval = []
    for record in builtin:
        seen[record["category"]] += 1
        if seen[record["category"]] > BUILTIN_EVAL_PER_CATEGORY:
            non_eval.append(record)
    assert len(builtin) == 160 and len(non_eval) == 120 and len(extra) == 400

    train, report = load_examples("builtin:train")
    assert report.skipped == 0 and len(train) == 520
    expected = non_eval + extra
    assert [e.id for e in train] == [r["id"] for r in expected]
    assert [_prompt(e) for e in train] == [r["prompt"] for r in expected]
    assert [e.category for e in train] == [r["category"] for r in expected]
    assert {e.source for e in train[:120]} == {str(builtin_prompts_path())}
    assert {e.source for e in train[120:]} == {str(builtin_train_prompts_path())}
    # a --limit within the first 120 reads builtin.jsonl only, as `make demo` does
    assert [e.id for e in load_examples("builtin:train", limit=64)[0]] == [r["id"] for r in non_eval[:64]]


def test_builtin_and_eval_read_builtin_jsonl_only():
    everything, _ = load_examples("builtin")
    evaluation, _ = load_examples("builtin:eval")
    assert [e.id for e in everything] == [r["id"] for r in _records(builtin_prompts_path())]
    assert len(evaluation) == 4 * BUILTIN_EVAL_PER_CATEGORY
    assert Counter(e.category for e in evaluation) == {c: BUILTIN_EVAL_PER_CATEGORY for c in TRAIN_COUNTS}


def test_train_jsonl_records():
    extra = _records(builtin_train_prompts_path())
    assert all(set(r) == {"id", "category", "prompt"} for r in extra)
    assert Counter(r["category"] for r in extra) == TRAIN_COUNTS
    assert all(r["id"].startswith(f"train-{r['category']}-") for r in extra)
    prompts = [r["prompt"] for r in extra]
    assert len(set(prompts)) == len(prompts) and all(p.strip() for p in prompts)
    examples, report = load_examples(str(builtin_train_prompts_path()))
    assert report.skipped == 0 and len(examples) == 400
    assert all([m["role"] for m in e.messages] == ["user"] for e in examples)


def test_ids_unique_and_eval_prompts_never_trained_on():
    ids = [r["id"] for r in _records(builtin_prompts_path()) + _records(builtin_train_prompts_path())]
    assert len(ids) == len(set(ids)) == 560
    evaluation, _ = load_examples("builtin:eval")
    train, _ = load_examples("builtin:train")
    train_text = "\n\n".join(_prompt(e) for e in train)
    leaked = [e.id for e in evaluation if _prompt(e) in train_text]
    assert not leaked, f"builtin:eval prompts found in builtin:train: {leaked}"
