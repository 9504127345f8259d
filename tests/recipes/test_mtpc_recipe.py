"""The real train/mtpc.py on a tiny byte model: torchrun with 2 CPU processes, exact resume,
export round trip, flags and bad input; and train/byte_lm.py end to end."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mtpkit.models.backbone import load_backbone
from mtpkit.models.mtpc.circuits import log_prob
from mtpkit.models.mtpc import load_head, window_targets
from mtpkit.train import byte_lm, export, mtpc

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--backbone", "tiny-byte-llama-random", "--max-length", "96", "--windows-per-sequence", "8",
        "--log-every", "1", "--eval-sequences", "2", "--rank", "3"]


def steps(metrics: Path) -> list[dict]:
    return [r for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]


def torchrun(*runs: list[str], timeout=300) -> None:
    """train/mtpc.py on 2 processes under torchrun, once per argument list in `runs`, all started
    together (their Python starts overlap on the 2 cores), each its own rendezvous on a free port
    (--standalone); every one must succeed."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH="")
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                               "train/mtpc.py", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for args in runs]
    try:
        ends = [proc.communicate(timeout=timeout) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for proc, (_, err) in zip(procs, ends):
        assert proc.returncode == 0, err[-3000:]


def test_help_lists_every_flag(capsys):
    with pytest.raises(SystemExit):
        mtpc.parse_args(["--help"])
    text = capsys.readouterr().out
    for flag in ("--config", "--backbone", "--data", "--output-dir", "--max-steps", "--arch", "--n", "-n",
                 "--rank", "--lora-layers", "--gamma", "--kl-weight", "--windows-per-sequence", "--resume",
                 "--init-from"):
        assert flag in text, flag
    assert "circuit structure: ff | cp | hmm | btree" in text


def test_bad_flags_name_the_flag(capsys):
    for argv, needle in ((["--arch", "tree"], "arch must be one of"), (["--arch", "btree", "--n", "6"], "power-of-two"),
                         (["--max-steps", "0"], "--max-steps")):
        with pytest.raises(SystemExit):
            mtpc.parse_args(argv)
        assert needle in capsys.readouterr().err


def test_gamma_defaults_follow_the_paper():
    assert mtpc.parse_args(["--n", "8"]).gamma == 0.8
    assert mtpc.parse_args(["--n", "16"]).gamma == 0.9


def test_torchrun_two_processes_checkpoint_resume_and_export(data, tmp_path):
    """4 steps straight vs 2 steps + resume to 4, both on 2 processes with LoRA draft layers:
    identical losses; then the export loads and gives the trained head's log-likelihoods."""
    common = [*TINY, "--data", str(data), "--arch", "btree", "-n", "4", "--lora-layers", "1", "--save-every", "2",
              "--eval-every", "2", "--max-steps", "4"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    torchrun([*common, "--output-dir", str(straight)], [*common, "--output-dir", str(resumed), "--max-steps", "2"])
    torchrun([*common, "--output-dir", str(resumed), "--resume", "auto"])
    for ckpt in ("checkpoint-2", "checkpoint-4"):
        for name in ("head/head.safetensors", "head/mtpkit_config.json", "trainer_state.json", "config.yaml",
                     "state/model.safetensors", "state/optimizer.safetensors", "state/optimizer.json",
                     "state/rng_0.json", "state/rng_1.json", "state/rng_1.safetensors"):
            assert (straight / ckpt / name).is_file(), name
    a, b = steps(straight / "metrics.jsonl"), steps(resumed / "metrics.jsonl")
    assert [r["step"] for r in a] == [1, 2, 3, 4] and [r["step"] for r in b] == [1, 2, 3, 4]
    for x, y in zip(a, b):
        for key in ("loss", "nll", "nll_per_offset", "lr", "bytes_seen"):
            assert x[key] == y[key], (x["step"], key)
    assert a[0]["loss"] != a[-1]["loss"]
    assert any("tf_acceptance" in json.loads(r) for r in (straight / "metrics.jsonl").read_text().splitlines())
    assert "lora_layers: 1" in (straight / "checkpoint-4" / "config.yaml").read_text()

    out = export.main(["--checkpoint", str(straight), "--out", str(tmp_path / "export")])
    assert "MTPC btree circuit head" in (out / "README.md").read_text()
    backbone, tokenizer = load_backbone("tiny-byte-llama-random")
    loaded = load_head(out, backbone)
    from safetensors.torch import load_file
    ref_state = load_file(str(straight / "checkpoint-4" / "head" / "head.safetensors"))
    assert set(ref_state) == set(loaded.trainable_state_dict())
    for k, v in loaded.trainable_state_dict().items():
        assert torch.equal(v, ref_state[k]), k
    ids = torch.tensor([tokenizer("Add 3 and 4.")["input_ids"]])
    labels = ids.roll(-1, 1)
    targets, valid = window_targets(labels, 4)
    params = loaded(ids, None, torch.zeros(ids.shape[1], dtype=torch.long), torch.arange(ids.shape[1]))
    ll = log_prob(params, targets[0], valid[0])
    assert torch.isfinite(ll).all()


def test_broken_records_are_skipped_and_counted(data, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(data.read_text() + "{not json\n" + json.dumps({"messages": "oops"}) + "\n")
    mtpc.main([*TINY, "--data", str(bad), "--output-dir", str(tmp_path / "run"), "--arch", "cp", "--n", "4",
               "--max-steps", "1", "--eval-every", "0"])
    captured = capsys.readouterr()
    err = captured.err + captured.out
    assert (tmp_path / "run" / "checkpoint-1" / "head" / "head.safetensors").is_file()
    assert "skipped 2 malformed" in err and "lines 25, 26" in err


def test_byte_lm_trains_saves_a_loadable_folder_and_resumes(tmp_path, monkeypatch):
    monkeypatch.setenv("MTPKIT_CACHE", str(tmp_path / "cache"))
    args = ["--data", "builtin", "--stdlib-mb", "0.2", "--hidden-size", "32", "--num-layers", "2", "--num-heads", "2",
            "--num-kv-heads", "1", "--intermediate-size", "64", "--block-size", "64", "--batch-size", "2",
            "--log-every", "1", "--eval-every", "2", "--eval-blocks", "1", "--save-every", "2", "--threads", "1"]
    a = byte_lm.main([*args, "--output-dir", str(tmp_path / "a"), "--max-steps", "4", "--install", "1"])
    byte_lm.main([*args, "--output-dir", str(tmp_path / "b"), "--max-steps", "2"])
    b = byte_lm.main([*args, "--output-dir", str(tmp_path / "b"), "--max-steps", "4", "--resume", "auto"])
    assert a["step"] == b["step"] == 4
    assert a["bpb/stdlib"] == b["bpb/stdlib"]
    sa, sb = steps(tmp_path / "a" / "metrics.jsonl"), steps(tmp_path / "b" / "metrics.jsonl")
    assert [r["step"] for r in sb] == [1, 2, 3, 4]
    for x, y in zip(sa, sb):
        assert (x["loss"], x["lr"]) == (y["loss"], y["lr"]), x["step"]
    for name in ("trainer_state.json", "config.yaml", "state/model.safetensors", "head/config.json",
                 "head/model.safetensors", "head/tokenizer_config.json"):
        assert (tmp_path / "b" / "checkpoint-4" / name).is_file(), name
    rows = [json.loads(r) for r in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    assert any("bpb/chat:builtin" in r for r in rows)
    model, tokenizer = load_backbone("mtpkit-byte-lm")  # the installed default
    assert model.config.hidden_size == 32 and len(tokenizer) == model.config.vocab_size
    ids = tokenizer("def f(x):\n    return x\n")["input_ids"]
    assert max(ids) < 256 and bytes(ids).decode() == "def f(x):\n    return x\n"


def test_missing_byte_lm_says_how_to_train_it(tmp_path, monkeypatch):
    monkeypatch.setenv("MTPKIT_CACHE", str(tmp_path / "empty"))
    from mtpkit.models.backbone import BackboneError
    with pytest.raises(BackboneError, match="train/byte_lm.py"):
        load_backbone("mtpkit-byte-lm")


def test_a_cirkit_circuit_head_trains_exports_and_decodes(data, tmp_path):
    """--arch cirkit --circuit linear-tree: a cirkit-built structure through the same training,
    export and decoder (greedy output equal to AR)."""
    from mtpkit.models.decoding.decoder import Target, decode
    from mtpkit.models.decoding.drafter import Drafter
    from mtpkit.models.mtpc.drafter import MTPCDraftConfig, MTPCDrafter

    result = mtpc.main([*TINY, "--data", str(data), "--output-dir", str(tmp_path / "run"), "--arch", "cirkit",
                        "--circuit", "linear-tree", "-n", "4", "--max-steps", "2", "--eval-every", "2"])
    assert "tf_acceptance" in result
    out = export.main(["--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "export")])
    assert json.loads((out / "mtpkit_config.json").read_text())["circuit"] == "linear-tree"
    backbone, tokenizer = load_backbone("tiny-byte-llama-random")
    head = load_head(out, backbone)
    assert type(head.head).__name__ == "CirkitHead"
    prompt = tokenizer("Add 3 and 4.")["input_ids"]
    target = Target(backbone)
    ar = decode(target, Drafter(), prompt, 12)
    spec = decode(target, MTPCDrafter(MTPCDraftConfig(), model=head), prompt, 12)
    assert spec.tokens == ar.tokens and spec.draft_nodes > 0
