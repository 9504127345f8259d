"""train/mtpc.py end to end on a tiny random EvaByte of the real architecture: a Hub-shaped
folder (config.json, weights, EvaByte's own modeling code as remote code, a byte tokenizer),
packed chat data, heads initialised from its 8 next-byte heads, 6 steps heads-only and with one
LoRA draft layer (its own EVA state), exact resume, the epoch count, export, and eval/bench.py with the exported head (chain, tree and
tree bank), pld and probe: greedy equal to AR, and speculative sampling."""

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


def test_export_then_bench_greedy_equals_ar_and_samples(evabyte, data, tmp_path):
    """The exported head (1 LoRA draft layer) through eval/bench.py, in process, on the tiny
    EvaByte (window 16): its hf_ar is EvaByte's own AR loop, the kernel plan is timed on the
    decoder's EVA cache (row counts that fit a window), and MTPC as a chain, a tree and a tree bank
    under a schedule, pld and probe (drafts the decoder cuts at each window end) decode greedily
    equal to AR across window ends; then speculative sampling at T = 1.0 runs the MTPC drafts."""
    import importlib

    bench = importlib.import_module("mtpkit.eval.bench")
    run = tmp_path / "run"
    mtpc.main([*TINY, "--backbone", str(evabyte), "--data", str(data), "--output-dir", str(run), "--max-steps", "2",
               "--lora-layers", "1"])
    head = export.main(["--checkpoint", str(run), "--out", str(tmp_path / "export")])
    assert load_head(head, load_backbone(str(evabyte), trust_remote_code=True)[0]).draft is not None
    tree, bank, prompts = tmp_path / "tree.json", tmp_path / "bank.json", tmp_path / "prompts.jsonl"
    tree.write_text("[[0], [1], [0, 0], [0, 1], [1, 0]]")
    bank.write_text(json.dumps({"trees": [{"paths": [[0], [1], [0, 0]]}, {"paths": [[0], [0, 0], [0, 0, 0]]}],
                                "schedules": {"t": {"ladder": {"kind": "ladder", "trees": [0, 1], "thresholds": [0.3]}}}}))
    prompts.write_text("\n".join(json.dumps({"category": "math", "turns": [text]})
                                 for text in ("Add 3 and 4.", "Add 5 and 6, then 7.")) + "\n")
    mtpc_specs = [f"mtpc:head={head}", f"mtpc:head={head},tree={tree}",
                  f"mtpc:head={head},tree={bank},schedule=ladder,task=t"]
    # greedy on two prompts, sampling on one (--linear auto's timing on EvaByte: tests/models/test_evabyte_real.py)
    for temperature, specs, limit in ((0.0, [*mtpc_specs, "pld", "probe:bc=10"], 2), (1.0, mtpc_specs, 1)):
        out = tmp_path / f"t{temperature}" / "results.json"
        results = bench.main(["--backbone", str(evabyte), "--trust-remote-code", "--data", str(prompts),
                              "--limit", str(limit), "--max-new-tokens", "24", "--temperature", str(temperature),
                              "--methods", *specs, "--linear", "stock", "--out", str(out)])
        methods = results["methods"]  # 31-byte prompts: across the window ends at 32 and 48
        assert list(methods) == ["ar", "hf_ar", *specs]
        for spec, r in methods.items():
            assert len(r["outputs"]) == limit
            if temperature:
                assert r["matches_ar"] is None and all(0 < len(o["output_ids"]) <= 24 for o in r["outputs"].values())
            else:
                assert r["matches_ar"] is True, spec
        for spec in specs:
            assert methods[spec]["mean_draft_nodes"] > 0, spec


@pytest.mark.parametrize("flags, named", [(["--methods", "hf_ar:compile=1"], "--methods hf_ar:compile=1"),
                                          (["--step", "static"], "--step static")])
def test_the_bench_refuses_what_evabyte_cannot_run_in_one_line(evabyte, tmp_path, flags, named):
    """transformers' compiled generate (EvaByte's code has none that takes its EVA cache) and a
    fixed-shape step (EVA decodes on its window cache, eagerly) are refused naming the flag."""
    import importlib

    bench = importlib.import_module("mtpkit.eval.bench")
    with pytest.raises(SystemExit) as e:
        bench.main(["--backbone", str(evabyte), "--trust-remote-code", "--data", "builtin:eval", "--limit", "1",
                    "--linear", "stock", *flags, "--out", str(tmp_path / "r.json")])
    assert str(e.value).startswith(f"bench: {named}: EvaByte") and "\n" not in str(e.value)
