"""The real train/medusa.py on the tiny model, in process: Medusa and Hydra runs that write
checkpoints and a simulated tau, the cached features read back by a second run, exact resume,
export -> load -> the bench decoding with the head (outputs identical to AR), bad flags."""

import json
from pathlib import Path

import pytest
import torch

from mtpkit.data import distill
from mtpkit.eval import bench
from mtpkit.models.backbone import load_backbone
from mtpkit.models.medusa import load_head
from mtpkit.train import export, medusa

TINY = ["--backbone", "tiny-llama-random", "--heads", "2", "--max-length", "128", "--log-every", "1",
        "--batch-size", "2", "--positions", "8", "--eval-prompts", "1", "--eval-max-new-tokens", "6"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("data") / "distilled.jsonl"
    distill.main(["--backbone", "tiny-llama-random", "--data", "builtin", "--limit", "6", "--max-new-tokens", "12",
                  "--out", str(out)])
    return out


def steps(metrics: Path) -> list[dict]:
    return [r for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]


def test_help_lists_every_flag(capsys):
    with pytest.raises(SystemExit):
        medusa.parse_args(["--help"])
    text = capsys.readouterr().out
    for flag in ("--config", "--backbone", "--data", "--arch", "--heads", "--layers", "--lm-head", "--prefix-layer",
                 "--distill",
                 "--positions", "--features", "--feature-cache", "--eval-tree", "--resume"):
        assert flag in text, flag
    assert "sequentially dependent" in text  # docstrings become help


@pytest.mark.parametrize("argv,needle", [(["--arch", "eagle"], "--arch must be one of"),
                                         (["--decay", "0"], "--decay must be"),
                                         (["--features", "disk"], "--features must be one of")])
def test_bad_flags_name_the_flag(capsys, argv, needle):
    with pytest.raises(SystemExit):
        medusa.parse_args(argv)
    assert needle in capsys.readouterr().err


def test_medusa_and_hydra_train_share_features_and_export(data, tmp_path):
    cache = tmp_path / "features.safetensors"
    common = [*TINY, "--data", str(data), "--feature-cache", str(cache), "--max-steps", "3", "--save-every", "3",
              "--eval-every", "3"]
    out = tmp_path / "medusa"
    result = medusa.main([*common, "--output-dir", str(out)])
    assert result["sim_tau"] >= 1.0 and len(steps(out / "metrics.jsonl")) == 3
    assert (out / "checkpoint-3" / "head" / "head.safetensors").is_file()
    written = cache.stat().st_mtime_ns
    hydra_out = tmp_path / "hydra"
    medusa.main([*common, "--output-dir", str(hydra_out), "--arch", "hydra", "--distill", "1"])
    assert cache.stat().st_mtime_ns == written  # the second run read the features back
    first = json.loads((hydra_out / "metrics.jsonl").read_text().splitlines()[0])
    assert first["feature_positions"] > 0
    config = json.loads((hydra_out / "checkpoint-3" / "head" / "mtpkit_config.json").read_text())
    assert config["method"] == "hydra" and config["heads"] == 2

    exported = tmp_path / "export"
    export.main(["--checkpoint", str(hydra_out), "--out", str(exported)])
    assert "Hydra draft heads" in (exported / "README.md").read_text()
    model, _ = load_backbone("tiny-llama-random")
    heads = load_head(exported, model)
    h = torch.randn(2, model.config.hidden_size)
    ckpt = load_head(hydra_out / "checkpoint-3", model)
    prev = torch.zeros(2, 2, dtype=torch.long)
    with torch.no_grad():
        torch.testing.assert_close(heads.logits(1, heads.hidden(1, h, prev)), ckpt.logits(1, ckpt.hidden(1, h, prev)))

    results = tmp_path / "bench" / "results.json"
    specs = [f"hydra:head={exported},tree=[[0],[1],[0,0]]", f"medusa:head={out / 'checkpoint-3'}"]
    bench.main(["--backbone", "tiny-llama-random", "--data", "builtin:eval", "--per-category", "1",
                "--max-new-tokens", "8", "--methods", *specs, "--out", str(results), "--linear", "stock"])
    saved = json.loads(results.read_text())["methods"]
    assert all(saved[spec]["matches_ar"] is True for spec in specs)


def test_resume_logs_the_same_losses(data, tmp_path):
    """Hydra++ (the prefix layer over whole sequences) interrupted at step 2 and resumed logs the
    losses of a run straight through."""
    common = [*TINY, "--data", str(data), "--feature-cache", str(tmp_path / "f.safetensors"), "--eval-every", "0",
              "--arch", "hydra", "--prefix-layer", "1"]
    straight = tmp_path / "straight"
    medusa.main([*common, "--output-dir", str(straight), "--max-steps", "4", "--save-every", "2"])
    resumed = tmp_path / "resumed"
    medusa.main([*common, "--output-dir", str(resumed), "--max-steps", "2", "--save-every", "2"])
    medusa.main([*common, "--output-dir", str(resumed), "--max-steps", "4", "--save-every", "2", "--resume", "auto"])
    a, b = steps(straight / "metrics.jsonl"), steps(resumed / "metrics.jsonl")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], rel=1e-6)
