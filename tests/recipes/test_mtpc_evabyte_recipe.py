"""train/mtpc.py end to end on a tiny random EvaByte of the real architecture: a Hub-shaped
folder (config.json, weights, EvaByte's own modeling code as remote code, a byte tokenizer),
packed chat data, heads initialised from its 8 next-byte heads, 6 steps heads-only and with one
LoRA draft layer (its own EVA state), exact resume, the epoch count, export, and the bench with
`mtpc:head=...` (greedy equal to AR, and speculative sampling)."""

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import save_file

from mtpkit.models.backbone import byte_tokenizer, load_backbone
from mtpkit.models.mtpc import load_head
from mtpkit.train import export, mtpc
from tests.models.test_evabyte_real import HUB_CONFIG, UPSTREAM, build, tiny_config

TINY = ["--max-length", "160", "--windows-per-sequence", "32", "--pack", "1", "--log-every", "1", "--eval-every", "0", "--rank", "2",
        "-n", "16", "--arch", "btree", "--lr", "5e-2", "--trust-remote-code", "1", "--save-every", "3"]


def steps(metrics):
    return [r for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]


@pytest.fixture(scope="module")
def evabyte(tmp_path_factory):
    folder = tmp_path_factory.mktemp("evabyte_hub")
    for source in UPSTREAM.glob("*.py"):
        shutil.copy(source, folder / source.name)
    (folder / "config.json").write_text(json.dumps(HUB_CONFIG, indent=1))
    model = build(tiny_config())
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    byte_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.parametrize("lora", [0, 1])
def test_six_steps_resume_exactly_and_report_epochs(evabyte, data, tmp_path, lora, capsys):
    common = [*TINY, "--backbone", str(evabyte), "--data", str(data), "--lora-layers", str(lora)]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    mtpc.main([*common, "--output-dir", str(straight), "--max-steps", "6"])
    log = capsys.readouterr()
    sequences = int(re.search(r"into (\d+) sequences", log.out + log.err).group(1))
    mtpc.main([*common, "--output-dir", str(resumed), "--max-steps", "3"])
    mtpc.main([*common, "--output-dir", str(resumed), "--max-steps", "6", "--resume", "auto"])
    a, b = steps(straight / "metrics.jsonl"), steps(resumed / "metrics.jsonl")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    for x, y in zip(a, b):
        for key in ("loss", "nll_per_offset", "bytes_seen", "epoch"):
            assert x[key] == y[key], (x["step"], key)
    assert [r["epoch"] for r in a] == [round(s / sequences, 4) for s in range(1, 7)]
    assert a[-1]["loss"] < a[0]["loss"]
    assert "lora_layers: %d" % lora in (straight / "checkpoint-6" / "config.yaml").read_text()
    saved = set(load_head(straight / "checkpoint-6" / "head", load_backbone(str(evabyte), trust_remote_code=True)[0])
                .trainable_state_dict())
    assert any("lora_" in k for k in saved) == bool(lora)


def test_epochs_set_the_budget(evabyte, data, tmp_path):
    """--epochs 1 (batch 2) runs the fewest steps that see every packed sequence once."""
    out = tmp_path / "run"
    result = mtpc.main([*TINY, "--backbone", str(evabyte), "--data", str(data), "--output-dir", str(out),
                        "--epochs", "1", "--batch-size", "2", "--max-steps", "1000"])
    rows = steps(out / "metrics.jsonl")
    assert result["step"] == len(rows) < 1000
    assert rows[-2]["epoch"] < 1.0 <= rows[-1]["epoch"]
    assert "max_steps: %d" % len(rows) in (out / f"checkpoint-{len(rows)}" / "config.yaml").read_text()


def test_the_head_starts_from_evabytes_8_heads(evabyte):
    """Sec. 4.1: window position i starts from EvaByte's head i (x_{t+1+i}); 8..15 from head 7."""
    from mtpkit.models.mtpc import MTPCConfig, MTPCModel

    model, _ = load_backbone(str(evabyte), trust_remote_code=True)
    heads = model.get_output_embeddings().weight.view(8, 320, -1)
    assert not torch.equal(heads[0], heads[1])
    W = MTPCModel(model, MTPCConfig(arch="btree", n=16, r=2)).head.unembed  # [n, r, V, d]
    for i in range(16):
        for j in range(2):
            assert torch.equal(W[i, j], heads[min(i, 7)].float()), (i, j)


def test_export_and_decode_greedy_equals_ar(evabyte, data, tmp_path):
    """The exported head (1 LoRA draft layer) through the shared decoder, as the bench's `ar` and
    `mtpc:head=DIR` run it: greedy output equal to AR, drafts accepted; speculative sampling runs.
    (eval/bench.py itself stops on EvaByte at its hf_ar, docs/mtpc.md.)"""
    from mtpkit.models.decoding.decoder import Target, decode
    from mtpkit.models.decoding.drafter import Drafter
    from mtpkit.models.mtpc.drafter import MTPCDraftConfig, MTPCDrafter

    run = tmp_path / "run"
    mtpc.main([*TINY, "--backbone", str(evabyte), "--data", str(data), "--output-dir", str(run), "--max-steps", "2",
               "--lora-layers", "1"])
    out = export.main(["--checkpoint", str(run), "--out", str(tmp_path / "export")])
    model, tokenizer = load_backbone(str(evabyte), trust_remote_code=True)
    head = load_head(out, model)
    assert head.draft is not None
    target = Target(model)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Add 3 and 4."}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
    ar = decode(target, Drafter(), prompt, 40)
    spec = decode(target, MTPCDrafter(MTPCDraftConfig(), model=head), prompt, 40)
    assert spec.tokens == ar.tokens and spec.draft_nodes > 0
