"""The real train/gated_lora.py on a tiny model: accelerate with 2 CPU processes (one process is
`accelerate launch` as typed, tests/recipes/test_literal_commands.py; DeepSpeed ZeRO-2 on CPU and its
resume by 2 processes, tests/recipes/test_multinode.py), exact resume (also from the earlier
checkpoint layout), export round trip, bad input."""

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mtpkit.data import distill
from mtpkit.data.mtp import collate_mask_inputs, mask_inputs
from mtpkit.models.backbone import load_backbone
from mtpkit.models.gated_lora import GatedLoRAConfig, GatedMTP, load_head
from mtpkit.train import checkpoints, export, gated_lora

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--backbone", "tiny-llama-random", "--k", "2", "--rank", "4", "--max-length", "256", "--log-every", "1",
        "--eval-prompts", "1", "--eval-max-new-tokens", "6"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("data") / "distilled.jsonl"
    distill.main(["--backbone", "tiny-llama-random", "--data", "builtin", "--limit", "6", "--max-new-tokens", "12",
                  "--out", str(out)])
    return out


def steps(metrics: Path) -> list[dict]:
    return [r for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]


def launch(args: list[str], tmp_path: Path, timeout=600) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", ACCELERATE_DISABLE_RICH="1", PYTHONPATH="")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def assert_checkpoint(out: Path, step: int):
    ckpt = out / f"checkpoint-{step}"
    for name in ("config.yaml", "trainer_state.json", "head/adapter_model.safetensors", "head/mtp_head.safetensors",
                 "head/mtpkit_config.json"):
        assert (ckpt / name).is_file(), name
    assert json.loads((ckpt / "trainer_state.json").read_text())["step"] == step
    assert (ckpt / "state").is_dir() and any((ckpt / "state").iterdir())
    assert "k: 2" in (ckpt / "config.yaml").read_text()


def test_help_lists_every_flag(capsys):
    with pytest.raises(SystemExit):
        gated_lora.parse_args(["--help"])
    text = capsys.readouterr().out
    for flag in ("--config", "--backbone", "--data", "--output-dir", "--max-steps", "--grad-accum", "--k", "--rank",
                 "--lcm-weight", "--lcm", "--gated", "--train-mask-embeds", "--anchors", "--cache-ntp", "--eval-every",
                 "--resume", "--mixed-precision"):
        assert flag in text
    assert "mask tokens appended after every loss-carrying token" in text  # docstrings become help


def test_accelerate_two_cpu_processes(data, tmp_path):
    out = tmp_path / "run"
    # `--cpu --num_processes 2` would start ONE process in accelerate 1.x (see configs/accelerate/cpu_ddp.yaml)
    proc = launch(["--config_file", "configs/accelerate/cpu_ddp.yaml", "train/gated_lora.py", *TINY, "--data", str(data),
                   "--output-dir", str(out), "--max-steps", "4", "--save-every", "2", "--eval-every", "0"], tmp_path)
    assert_checkpoint(out, 4)
    assert len(steps(out / "metrics.jsonl")) == 4  # only the main process writes
    assert proc.stdout.count("[model]") == 1 and "2 process(es), MULTI_CPU" in proc.stdout
    state = out / "checkpoint-4" / "state"
    assert all((state / f"rng_{rank}.{ext}").is_file() for rank in (0, 1) for ext in ("json", "safetensors"))


@pytest.mark.parametrize("layout", ["current", "earlier"])
def test_resume_gives_the_same_losses(data, tmp_path, layout, monkeypatch):
    """4 steps straight == 2 steps + resume to 4, with a random half of the mask blocks (the resumed
    run draws the same anchors). `current`: state/ of tensors and JSON only.
    `earlier`: state/ as accelerate's save_state wrote it (pickles), with the LR scheduler the
    earlier layout pickled (custom_checkpoint_0.pkl): refused without --trust-checkpoint 1, which
    resumes it exactly."""
    common = [*TINY, "--data", str(data), "--eval-every", "0", "--save-every", "2", "--grad-accum", "2",
              "--warmup-steps", "3", "--anchors", "0.5"]
    gated_lora.main([*common, "--output-dir", str(tmp_path / "a"), "--max-steps", "4"])
    with monkeypatch.context() as m:
        if layout == "earlier":
            m.setattr(checkpoints, "save_state", lambda acc, trainable, opt, folder: acc.save_state(str(folder)))
        gated_lora.main([*common, "--output-dir", str(tmp_path / "b"), "--max-steps", "2"])
    state = tmp_path / "b" / "checkpoint-2" / "state"
    files = sorted(p.name for p in state.iterdir())
    resume = [*common, "--output-dir", str(tmp_path / "b"), "--max-steps", "4", "--resume", "auto"]
    if layout == "current":
        assert not any(f.endswith((".pkl", ".bin", ".pt")) for f in files), files
    else:
        assert "random_states_0.pkl" in files
        torch.save({"last_epoch": 2, "base_lrs": [5e-4]}, state / "custom_checkpoint_0.pkl")
        with pytest.raises(SystemExit, match="--trust-checkpoint 1"):
            gated_lora.main(resume)
        resume += ["--trust-checkpoint", "1"]
    gated_lora.main(resume)
    a, b = steps(tmp_path / "a" / "metrics.jsonl"), steps(tmp_path / "b" / "metrics.jsonl")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for x, y in zip(a, b):
        for key in ("loss", "base_mtp", "sampler_mtp", "lcm", "lr"):
            assert x[key] == y[key], (x["step"], key)
    assert a[3]["loss"] != a[2]["loss"]


def test_export_round_trip(data, tmp_path):
    run = tmp_path / "run"
    gated_lora.main([*TINY, "--data", str(data), "--output-dir", str(run), "--max-steps", "3", "--eval-every", "0",
                     "--lr", "0.05", "--train-mask-embeds", "1"])
    folder = export.main(["--checkpoint", str(run), "--out", str(tmp_path / "export")])
    card = (folder / "README.md").read_text()
    assert "k = 2" in card and "tiny-llama-random" in card
    base, _ = load_backbone("tiny-llama-random")
    loaded = load_head(folder, copy.deepcopy(base)).eval()
    # the trained model, rebuilt from the accelerate checkpoint's own weights
    trained = GatedMTP(copy.deepcopy(base), GatedLoRAConfig(k=2, rank=4, train_mask_embeds=True))
    trained.load_state_dict(load_file(str(run / "checkpoint-3" / "state" / "model.safetensors")))
    trained.eval()
    assert not torch.equal(trained.mask_embeds, GatedMTP(copy.deepcopy(base), GatedLoRAConfig(k=2, rank=4)).mask_embeds)
    ids = torch.arange(20, 34)
    labels = torch.cat([torch.full((5,), -100), ids[5:]])
    batch = collate_mask_inputs([mask_inputs(ids, labels, 2)])
    args = (batch["input_ids"], batch["mask_index"], batch["position_ids"], batch["attention_mask"])
    with torch.no_grad():
        h1, h2 = trained.hidden_states(*args), loaded.hidden_states(*args)
        assert torch.equal(trained.lm_head(h1), loaded.lm_head(h2))
        assert torch.equal(trained.sampler_logits(batch["prev_ids"], h1), loaded.sampler_logits(batch["prev_ids"], h2))



def test_sim_tau_rows_carry_training_seconds(data, tmp_path, monkeypatch):
    """As train/medusa.py's: each sim_tau row's train_seconds leaves evaluation (slowed to 1 s
    here) out and goes on across a resume."""
    fast = gated_lora.simulated_tau

    def slow(*args):
        time.sleep(1.0)
        return fast(*args)

    monkeypatch.setattr(gated_lora, "simulated_tau", slow)
    common = [*TINY, "--data", str(data), "--eval-every", "1", "--save-every", "2", "--output-dir", str(tmp_path / "run")]
    gated_lora.main([*common, "--max-steps", "2"])
    gated_lora.main([*common, "--max-steps", "4", "--resume", "auto"])
    rows = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) if "sim_tau" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    seconds = [r["train_seconds"] for r in rows]
    assert 0 < seconds[0] and all(a < b for a, b in zip(seconds, seconds[1:])), seconds
    assert seconds[-1] - seconds[0] < 1.0, seconds

def test_broken_records_are_skipped_and_counted(data, tmp_path, capsys):
    broken = tmp_path / "broken.jsonl"
    lines = data.read_text().splitlines()
    broken.write_text("\n".join(lines[:2] + ["{not json"] + lines[2:]) + "\n")
    gated_lora.main([*TINY, "--data", str(broken), "--output-dir", str(tmp_path / "r"), "--max-steps", "1",
                     "--eval-every", "0"])
    err = capsys.readouterr()
    text = err.out + err.err
    assert "broken.jsonl" in text and "skipped 1" in text and "3" in text


def test_config_errors_name_the_file_and_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_steps: 3\nmodel:\n  rnak: 4\n")
    with pytest.raises(SystemExit):
        gated_lora.parse_args(["--config", str(bad)])
    with pytest.raises(SystemExit):
        gated_lora.parse_args(["--k", "two"])
    cfg = gated_lora.parse_args(["--config", str(ROOT / "configs/gated_lora/smollm2-135m_k4.yaml"), "--k", "2"])
    assert cfg.model.k == 2 and cfg.max_steps == 360 and cfg.lr == 1e-3 and cfg.anchors == 0.25
    best = gated_lora.parse_args(["--config", str(ROOT / "configs/gated_lora/smollm2-135m_k4_nosampler.yaml")])
    assert (best.model.sampler, best.model.lcm_weight, best.max_steps, best.decay_steps) == (False, 0.0, 800, 200)
    assert best.model.k == 4 and not best.model.train_mask_embeds and best.anchors == 0.25
    paper = gated_lora.parse_args(["--config", str(ROOT / "configs/gated_lora/tulu3-8b_k8.yaml")])
    assert (paper.model.k, paper.model.rank, paper.lr, paper.warmup_steps, paper.max_steps) == (8, 128, 2e-4, 5000, 50000)


def test_model_card_names_the_parts_the_head_was_trained_with():
    """A head trained without the sampler or the LCM term says so on its card, and its bench line
    runs (sampler=0: the drafter refuses sampler=1 on a head without a sampler)."""
    from mtpkit.models.gated_lora.head import model_card

    def card(**settings):
        return model_card({"k": 4, "base_model": "smollm2-135m-instruct",
                           "gated_lora": {**GatedLoRAConfig().__dict__, **settings}})

    full = card()
    assert "a sampler MLP" in full.about and "latent-consistency" in full.about
    assert "sampler=0" not in full.bench
    basic = card(sampler=False, lcm_weight=0.0)
    assert "no sampler MLP" in basic.about and "latent-consistency" not in basic.about
    assert "+ sampler" not in basic.about and basic.bench.endswith(",sampler=0")
