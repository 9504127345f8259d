"""data/mix.py on small stand-ins for the dataset files: the prompt mix (counts, categories,
prompt-only records that data/distill.py reads, long prompts left out, a fixed shuffle), the
held-out eval prompts, and a missing file as one error line."""

import gzip
import json

import pytest

from mtpkit.data import mix
from mtpkit.data.chat import load_examples


def write(path, rows):
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


@pytest.fixture
def data_dir(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    write(d / "gsm8k_train.jsonl", [{"question": f"q{i}?", "answer": "#### 1"} for i in range(5)])
    write(d / "code_alpaca_2k.jsonl", [{"instruction": f"do {i}", "input": "x" if i % 2 else "", "output": "y"}
                                       for i in range(5)])
    chats = [{"id": f"c{i}", "conversations": [{"from": "human", "value": "hi" * (1 + 500 * (i == 4))},
                                                {"from": "gpt", "value": "hello"}]} for i in range(5)]
    chats[3]["conversations"] = [{"from": "gpt", "value": "no human turn"}]
    write(d / "sharegpt_1k.jsonl", chats)
    write(d / "humaneval.jsonl.gz", [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}():"} for i in range(4)])
    write(d / "gsm8k_test.jsonl", [{"question": f"t{i}?", "answer": "#### 2"} for i in range(4)])
    return d


def test_train_mix(data_dir, tmp_path):
    out = tmp_path / "mix.jsonl"
    assert mix.main(["--data-dir", str(data_dir), "--out", str(out), "--math", "3", "--code", "2", "--chat", "3",
                     "--max-prompt-chars", "100"]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    # chat: the last 3 records, one without a human turn answered, one over 100 characters
    assert sorted(r["id"] for r in records) == sorted(["gsm8k-train-0", "gsm8k-train-1", "gsm8k-train-2",
                                                        "code-alpaca-0", "code-alpaca-1", "sharegpt-c2"])
    assert {r["category"] for r in records} == {"math", "code", "chat"}
    assert all([m["role"] for m in r["messages"]] == ["user"] for r in records)
    assert next(r for r in records if r["id"] == "code-alpaca-1")["messages"][0]["content"] == "do 1\n\nx"
    again = tmp_path / "again.jsonl"
    mix.main(["--data-dir", str(data_dir), "--out", str(again), "--math", "3", "--code", "2", "--chat", "3",
              "--max-prompt-chars", "100"])
    assert again.read_text() == out.read_text()  # the shuffle is seeded
    examples, _ = load_examples(str(out))
    assert len(examples) == len(records)


def test_eval_prompts_alternate_humaneval_and_gsm8k_test(data_dir, tmp_path):
    out = tmp_path / "eval.jsonl"
    assert mix.main(["--data-dir", str(data_dir), "--out", str(out), "--eval", "2"]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["category"] for r in records] == ["humaneval", "gsm8k_test"] * 2
    assert [r["messages"][0]["content"] for r in records] == ["def f0():", "t0?", "def f1():", "t1?"]


def test_a_missing_file_is_one_error_line(tmp_path, capsys):
    assert mix.main(["--data-dir", str(tmp_path), "--out", str(tmp_path / "m.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "gsm8k_train.jsonl" in err and len(err.strip().splitlines()) == 1


def test_answers_keeps_the_files_own_replies(data_dir, tmp_path):
    out = tmp_path / "mix.jsonl"
    mix.main(["--data-dir", str(data_dir), "--out", str(out), "--math", "1", "--code", "1", "--chat", "1", "--answers"])
    records = {r["id"]: r["messages"] for r in map(json.loads, out.read_text().splitlines())}
    assert records == {"gsm8k-train-0": [{"role": "user", "content": "q0?"}, {"role": "assistant", "content": "#### 1"}],
                       "code-alpaca-0": [{"role": "user", "content": "do 0"}, {"role": "assistant", "content": "y"}],
                       "sharegpt-c4": [{"role": "user", "content": "hi" * 501}, {"role": "assistant", "content": "hello"}]}


def test_exclude_leaves_out_the_ids_of_a_set_keeping_the_order(data_dir, tmp_path, capsys):
    full, rest = tmp_path / "full.jsonl", tmp_path / "rest.jsonl"
    assert mix.main(["--data-dir", str(data_dir), "--out", str(full)]) == 0
    records = [json.loads(line) for line in full.read_text().splitlines()]
    done = tmp_path / "done.jsonl"
    done.write_text("".join(json.dumps({"id": r["id"], "messages": []}) + "\n" for r in records[::2]))
    assert mix.main(["--data-dir", str(data_dir), "--out", str(rest), "--exclude", str(done)]) == 0
    assert [json.loads(line) for line in rest.read_text().splitlines()] == records[1::2]  # same shuffle, same order
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    assert mix.main(["--data-dir", str(data_dir), "--out", str(rest), "--exclude", str(bad)]) == 2
    assert "--exclude" in capsys.readouterr().err
