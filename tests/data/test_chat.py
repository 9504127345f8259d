import gzip
import json

import pytest
import torch

from mtpkit.data.chat import (IGNORE, DataError, collate, load_examples, pack, prompt_ids, to_messages,
                              tokenize_chat)

RECORDS = {
    "sharegpt": {"id": "s1", "conversations": [
        {"from": "system", "value": "Be brief."}, {"from": "human", "value": "Name a fruit."},
        {"from": "gpt", "value": "An apple."}, {"from": "human", "value": "And a colour?"},
        {"from": "gpt", "value": "Blue, like\nthe sea."}]},
    "openai": {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                            {"role": "user", "content": "times 3?"}, {"role": "assistant", "content": "12 é"}]},
    "alpaca": {"instruction": "Translate to French.", "input": "cat", "output": "chat"},
    "turns": {"question_id": 81, "category": "writing", "turns": ["Write a haiku.", "Now another."]},
    "prompt": {"task_id": "HumanEval/0", "prompt": "def f(x):\n", "canonical_solution": "    return x\n"},
    "question": {"question": "Tom has 3 apples...", "answer": "He has 3.\n#### 3"},
}
ASSISTANT_TEXTS = {
    "sharegpt": ["An apple.", "Blue, like\nthe sea."], "openai": ["4", "12 é"], "alpaca": ["chat"],
    "turns": [], "prompt": ["    return x\n"], "question": ["He has 3.\n#### 3"],
}


def _spans(labels):
    """Maximal runs of labelled positions, as (start, end)."""
    spans, start = [], None
    for i, lab in enumerate(labels + [IGNORE]):
        if lab != IGNORE and start is None:
            start = i
        elif lab == IGNORE and start is not None:
            spans.append((start, i))
            start = None
    return spans


@pytest.mark.parametrize("fmt", sorted(RECORDS))
@pytest.mark.parametrize("backbone_fixture", ["tiny", "tiny_byte", "smollm2"])
def test_labels_cover_exactly_the_assistant_tokens(fmt, backbone_fixture, request):
    _, tokenizer = request.getfixturevalue(backbone_fixture)
    feat = tokenize_chat(tokenizer, to_messages(RECORDS[fmt]))
    ids, labels = feat["input_ids"], feat["labels"]
    assert len(ids) == len(labels)
    for i, lab in enumerate(labels):
        assert lab in (IGNORE, ids[i])
    spans = _spans(labels)
    # one labelled span per assistant turn: its content then the end-of-turn token; the only
    # extra text allowed is whitespace of a first token that straddles the role header (BPE)
    assert len(spans) == len(ASSISTANT_TEXTS[fmt])
    for (a, b), content in zip(spans, ASSISTANT_TEXTS[fmt]):
        decoded = tokenizer.decode(ids[a:b])
        assert decoded.endswith(content + tokenizer.eos_token)
        assert not decoded[: -len(content + tokenizer.eos_token)].strip()
        assert content not in tokenizer.decode(ids[a + 1:b])  # minimal: the first token is needed
    # the unlabelled rest is the whole conversation minus those spans (role headers, user text)
    unlabelled = "".join(tokenizer.decode(ids[a:b]) for a, b in _complement(spans, len(ids)))
    for msg in to_messages(RECORDS[fmt]):
        if msg["role"] != "assistant":
            assert msg["content"] in unlabelled


def _complement(spans, n):
    out, prev = [], 0
    for a, b in spans:
        out.append((prev, a))
        prev = b
    return out + [(prev, n)]


def test_prompt_ids_stop_before_the_first_answer(tiny):
    _, tokenizer = tiny
    msgs = to_messages(RECORDS["openai"])
    text = tokenizer.decode(prompt_ids(tokenizer, msgs))
    assert text.endswith("2+2?<|im_end|>\n<|im_start|>assistant\n") and "4" not in text


def test_truncation(tiny):
    _, tokenizer = tiny
    feat = tokenize_chat(tokenizer, to_messages(RECORDS["sharegpt"]), max_length=10)
    assert len(feat["input_ids"]) == len(feat["labels"]) == 10


def test_sharegpt_leading_assistant_turn_is_dropped():
    msgs = to_messages({"conversations": [{"from": "gpt", "value": "cut"}, {"from": "human", "value": "q"},
                                          {"from": "gpt", "value": "a"}]})
    assert [m["role"] for m in msgs] == ["user", "assistant"]


def test_malformed_lines_are_skipped_and_counted(tmp_path):
    path = tmp_path / "mixed.jsonl"
    lines = [json.dumps(RECORDS["alpaca"]), "{not json", json.dumps({"foo": 1}), "",
             json.dumps(RECORDS["openai"]), json.dumps({"messages": [{"role": "robot", "content": "x"}]})]
    path.write_text("\n".join(lines) + "\n")
    examples, report = load_examples(str(path))
    assert len(examples) == 2 and report.loaded == 2 and report.skipped == 3
    assert [n for n, _ in report.bad_lines[str(path)]] == [2, 3, 6]
    assert "mixed.jsonl" in report.summary() and "lines 2, 3, 6" in report.summary()
    assert examples[0].id == "mixed-1"  # no id field: file stem and line number


def test_unreadable_and_empty_files_are_clear_errors(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_examples(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(b"this is not gzip")
    with pytest.raises(DataError, match="bad.jsonl.gz: cannot read"):
        load_examples(str(bad))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("{broken\n")
    with pytest.raises(DataError, match="no usable records"):
        load_examples(str(empty))


def test_json_list_and_gzip(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([RECORDS["question"], RECORDS["turns"]]))
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.write(json.dumps(RECORDS["prompt"]) + "\n")
    a, _ = load_examples(str(tmp_path / "a.json"))
    b, _ = load_examples(str(tmp_path / "b.jsonl.gz"))
    assert [e.category for e in a] == ["default", "writing"] and a[1].id == "81"
    assert b[0].id == "HumanEval/0"


def test_builtin_prompts_cover_four_categories():
    examples, report = load_examples("builtin")
    assert report.skipped == 0 and len(examples) >= 100
    assert {e.category for e in examples} == {"code", "math", "chat", "summarisation"}


def test_shared_benchmarks_parse(shared_data):
    humaneval, r1 = load_examples(str(shared_data / "humaneval.jsonl.gz"))
    gsm8k, r2 = load_examples(str(shared_data / "gsm8k_test.jsonl"), limit=50)
    sharegpt, r3 = load_examples(str(shared_data / "sharegpt_1k.jsonl"))
    assert len(humaneval) == 164 and len(gsm8k) == 50 and r1.skipped == r2.skipped == 0
    assert len(sharegpt) + r3.skipped == 1000 and len(sharegpt) > 950


def test_packing_masks_out_other_documents(tiny):
    model, tokenizer = tiny
    feats = [tokenize_chat(tokenizer, to_messages(RECORDS[k])) for k in ("alpaca", "openai", "question")]
    blocks = pack(feats, block_size=10_000)
    assert len(blocks) == 1
    batch = collate(blocks, tokenizer.pad_token_id)
    packed_logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                          position_ids=batch["position_ids"]).logits[0]
    start = 0
    for feat in feats:  # each packed document scores exactly as it does alone
        n = len(feat["input_ids"])
        alone = model(input_ids=torch.tensor([feat["input_ids"]])).logits[0]
        torch.testing.assert_close(packed_logits[start:start + n], alone, rtol=1e-5, atol=1e-5)
        start += n
    assert torch.equal(batch["labels"][0], torch.tensor(sum((f["labels"] for f in feats), [])))


def test_collate_pads_right_with_ignored_labels(tiny):
    _, tokenizer = tiny
    feats = [{"input_ids": [5, 6, 7], "labels": [IGNORE, 6, 7]}, {"input_ids": [8], "labels": [8]}]
    batch = collate(feats, tokenizer.pad_token_id)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, tokenizer.pad_token_id, tokenizer.pad_token_id]]
    assert batch["labels"].tolist() == [[IGNORE, 6, 7], [8, IGNORE, IGNORE]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
