import json

import pytest

from mtpkit.data import distill as distill_mod
from mtpkit.data.chat import load_examples, tokenize_chat

ARGS = ["--backbone", "tiny-llama-random", "--data", "builtin", "--limit", "10", "--max-new-tokens", "12",
        "--batch-size", "3"]


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_interrupted_distillation_resumes_without_duplicates_or_losses(tmp_path, monkeypatch):
    full = tmp_path / "full.jsonl"
    distill_mod.main(ARGS + ["--out", str(full)])
    reference = {r["id"]: r for r in _records(full)}
    assert len(reference) == 10

    # Interrupt during the third batch, after two batches (6 records) were written ...
    out = tmp_path / "resumed.jsonl"
    real_generate, calls = distill_mod.generate, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_generate(*args, **kwargs)

    monkeypatch.setattr(distill_mod, "generate", flaky)
    with pytest.raises(KeyboardInterrupt):
        distill_mod.main(ARGS + ["--out", str(out)])
    assert len(_records(out)) == 6
    # ... and a crash mid-write that left half a line behind.
    with open(out, "a") as f:
        f.write(json.dumps(reference[next(iter(reference))])[:40])
    monkeypatch.setattr(distill_mod, "generate", real_generate)

    summary = distill_mod.main(ARGS + ["--out", str(out)])
    assert summary["already_done"] == 6 and summary["written"] == 4
    resumed = _records(out)
    assert sorted(r["id"] for r in resumed) == sorted(reference)  # each id exactly once
    assert {r["id"]: r for r in resumed} == reference  # greedy: the same records as uninterrupted

    again = distill_mod.main(ARGS + ["--out", str(out)])  # nothing left to do
    assert again["written"] == 0 and len(_records(out)) == 10


def test_output_is_a_training_dataset(tmp_path, tiny):
    out = tmp_path / "d.jsonl"
    distill_mod.main(ARGS + ["--out", str(out), "--temperature", "0.8", "--top-p", "0.9"])
    examples, report = load_examples(str(out))
    assert len(examples) == 10 and report.skipped == 0
    _, tokenizer = tiny
    for ex in examples:
        assert ex.messages[-1]["role"] == "assistant"
        feat = tokenize_chat(tokenizer, ex.messages)
        assert any(lab != -100 for lab in feat["labels"])


@pytest.mark.parametrize("bad", [["--batch-size", "0"], ["--temperature", "-1"], ["--top-p", "0"]])
def test_bad_flags_are_clear_errors(bad, tmp_path, capsys):
    with pytest.raises(SystemExit):
        distill_mod.parse_args(["--out", str(tmp_path / "x.jsonl")] + bad)
    assert bad[0] in capsys.readouterr().err


def test_script_runs_as_documented(tmp_path, capsys):
    """`python data/distill.py ...` works as a script (no module shadowing from data/ on sys.path);
    its --help names every flag."""
    import subprocess
    import sys
    from pathlib import Path

    with pytest.raises(SystemExit):
        distill_mod.parse_args(["--help"])
    help_text = capsys.readouterr().out
    for flag in ("--backbone", "--data", "--out", "--limit", "--max-new-tokens", "--temperature", "--batch-size",
                 "--device", "--dtype", "--wait-timeout", "torchrun --nproc_per_node"):
        assert flag in help_text
    script = Path(__file__).resolve().parents[2] / "data" / "distill.py"
    out = tmp_path / "d.jsonl"
    run = subprocess.run([sys.executable, str(script), *ARGS, "--limit", "2", "--out", str(out)],
                         capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert len(_records(out)) == 2 and "wrote 2 records" in run.stdout


def test_every_assistant_turn_is_regenerated_on_the_targets_own_history(tmp_path, tiny):
    from mtpkit.data.chat import generation_prompt_ids
    from mtpkit.models.generate import generate

    model, tokenizer = tiny
    conv = {"id": "c1", "conversations": [
        {"from": "system", "value": "Be brief."}, {"from": "human", "value": "Name a fruit."},
        {"from": "gpt", "value": "ORIGINAL 1"}, {"from": "human", "value": "And a colour?"},
        {"from": "gpt", "value": "ORIGINAL 2"}]}
    data = tmp_path / "sharegpt.jsonl"
    data.write_text(json.dumps(conv) + "\n" + json.dumps({**conv, "id": "c2"}) + "\n")
    base = ["--backbone", "tiny-llama-random", "--data", str(data), "--max-new-tokens", "10"]

    out = tmp_path / "all.jsonl"
    distill_mod.main(base + ["--out", str(out)])
    msgs = _records(out)[0]["messages"]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]

    def greedy(history):
        gen = generate(model, [generation_prompt_ids(tokenizer, history)], 10, [tokenizer.eos_token_id],
                       tokenizer.pad_token_id)[0]
        return tokenizer.decode(gen[:-1] if gen[-1] == tokenizer.eos_token_id else gen)

    assert msgs[2]["content"] == greedy(msgs[:2])  # turn 1 from the prompt
    assert msgs[4]["content"] == greedy(msgs[:4])  # turn 2 conditioned on the regenerated turn 1
    assert "ORIGINAL" not in json.dumps(msgs)

    first_only = tmp_path / "first.jsonl"
    distill_mod.main(base + ["--out", str(first_only), "--max-turns", "1"])
    assert [m["role"] for m in _records(first_only)[0]["messages"]] == ["system", "user", "assistant"]

    too_long = distill_mod.main(base + ["--out", str(tmp_path / "none.jsonl"), "--max-prompt-tokens", "5"])
    assert too_long["skipped_too_long"] == 2 and too_long["written"] == 0


@pytest.mark.parametrize("bad", [["--limit", "0"], ["--limit", "-1"], ["--max-prompt-tokens", "0"],
                                 ["--max-turns", "0"], ["--temperature", "nan"], ["--temperature", "inf"],
                                 ["--top-p", "nan"], ["--show", "-1"], ["--dtype", "int8"], ["--device", "tpu"],
                                 ["--device", "cuda:99"], ["--wait-timeout", "0"]])
def test_bad_values_are_refused_before_anything_runs(bad, tmp_path, capsys):
    out = tmp_path / "x.jsonl"
    with pytest.raises(SystemExit) as stop:
        distill_mod.main(ARGS + ["--out", str(out)] + bad)
    assert stop.value.code == 2 and bad[0] in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize("flags, dtype", [([], "float32"), (["--dtype", "auto"], "float32"),
                                          (["--dtype", "bfloat16"], "bfloat16"), (["--dtype", "fp16"], "float16")])
def test_device_and_dtype_reach_the_model_and_the_generation(flags, dtype, tmp_path, monkeypatch):
    """`--dtype auto` on a CPU is float32; the model generates on `--device`."""
    import torch

    seen, real_generate = [], distill_mod.generate

    def spy(model, *args, **kwargs):
        seen.append((model.dtype, model.device, args[-1].device))  # the sampling generator too
        return real_generate(model, *args, **kwargs)

    monkeypatch.setattr(distill_mod, "generate", spy)
    distill_mod.main(ARGS + ["--limit", "2", "--device", "cpu", "--out", str(tmp_path / "d.jsonl")] + flags)
    assert seen and set(seen) == {(getattr(torch, dtype), torch.device("cpu"), torch.device("cpu"))}


@pytest.mark.parametrize("same", ["path", "relative", "symlink"])
def test_out_equal_to_data_is_refused_and_the_input_kept(same, tmp_path, capsys, monkeypatch):
    data = tmp_path / "prompts.jsonl"
    text = "\n".join(json.dumps({"id": i, "messages": [{"role": "user", "content": "hi"}]}) for i in "ab")
    data.write_text(text)  # no final newline: resuming would cut the last line
    monkeypatch.chdir(tmp_path)
    out = {"path": str(data), "relative": "./prompts.jsonl", "symlink": str(tmp_path / "link.jsonl")}[same]
    if same == "symlink":
        (tmp_path / "link.jsonl").symlink_to(data)
    with pytest.raises(SystemExit) as stop:
        distill_mod.main(["--backbone", "tiny-llama-random", "--data", str(data), "--out", out])
    assert stop.value.code == 2 and "is the --data file" in capsys.readouterr().err
    assert data.read_text() == text


def test_out_that_is_a_folder_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        distill_mod.main(ARGS + ["--out", str(tmp_path)])
    assert "is a folder" in capsys.readouterr().err


@pytest.mark.parametrize("case", ["missing", "all_malformed", "bad_json_list", "unknown_builtin", "unknown_backbone",
                                  "head_as_backbone", "unwritable_out"])
def test_user_errors_are_one_line_not_a_traceback(case, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    broken = tmp_path / "broken.json"
    broken.write_text("[{")
    head = tmp_path / "head"
    head.mkdir()
    (head / "mtpkit_config.json").write_text('{"method": "mtpc", "base_model": "x"}')
    blocker = tmp_path / "file"
    blocker.write_text("")
    args = {"missing": ["--data", str(tmp_path / "nope.jsonl")], "all_malformed": ["--data", str(bad)],
            "bad_json_list": ["--data", str(broken)], "unknown_builtin": ["--data", "builtin:nope"],
            "unknown_backbone": ["--backbone", "no-such-model"], "head_as_backbone": ["--backbone", str(head)],
            "unwritable_out": ["--out", str(blocker / "x.jsonl")]}[case]
    needle = {"missing": "nope.jsonl: no such file", "all_malformed": "bad.jsonl: no usable records",
              "bad_json_list": "broken.json: not valid JSON at line 1", "unknown_builtin": "builtin:nope",
              "unknown_backbone": "no-such-model", "head_as_backbone": "mtpkit mtpc head",
              "unwritable_out": str(blocker)}[case]
    with pytest.raises(SystemExit) as stop:
        distill_mod.main(ARGS + ["--out", str(tmp_path / "out.jsonl")] + args)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("error: ") and needle in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_a_record_holding_a_unicode_line_break_counts_as_done(tmp_path):
    """Lines end at "\\n" only: json.dumps(ensure_ascii=False) leaves U+2028 inside a record."""
    out = tmp_path / "d.jsonl"
    record = {"id": "a", "messages": [{"role": "assistant", "content": "one\u2028two\u0085three"}]}
    out.write_text(json.dumps(record, ensure_ascii=False) + "\n" + '{"id": "b"', encoding="utf-8")
    assert distill_mod.read_done(out) == ({"a"}, 0)
    assert out.read_text(encoding="utf-8").endswith("three\"}]}\n")  # the half-written line is cut off
