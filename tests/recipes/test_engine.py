"""What the three recipes share (train/engine.py, train/schedule.py, train/checkpoints.py): the
config fields and every YAML in configs/, the learning-rate schedule, the log window, and what
`--resume` says to a checkpoint of the earlier layouts."""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from mtpkit.train import byte_lm, engine, gated_lora, mtpc
from mtpkit.train.schedule import lr_multiplier

ROOT = Path(__file__).resolve().parents[2]
RECIPES = {"gated_lora": gated_lora, "mtpc": mtpc, "byte_lm": byte_lm}


@pytest.mark.parametrize("path", sorted(p.relative_to(ROOT) for p in ROOT.glob("configs/*/*.yaml")
                                        if p.parent.name in RECIPES), ids=str)
def test_every_recipe_config_parses(path):
    cfg = RECIPES[path.parent.name].parse_args(["--config", str(ROOT / path)])
    assert isinstance(cfg, engine.TrainArgs) and cfg.output_dir.startswith("runs/")
    head = [line for line in (ROOT / path).read_text().splitlines() if line.startswith("#")]
    assert any(f"train/{path.parent.name}.py" in line or "launch/slurm_" in line for line in head)  # how to run it


def test_shared_fields_keep_their_flags_and_each_recipe_its_defaults(capsys):
    for recipe in RECIPES.values():
        with pytest.raises(SystemExit):
            recipe.parse_args(["--help"])
        text = capsys.readouterr().out
        for flag in ("--output-dir", "--max-steps", "--batch-size", "--grad-accum", "--lr", "--warmup-steps",
                     "--decay-steps", "--lr-decay", "--min-lr-ratio", "--weight-decay", "--max-grad-norm",
                     "--mixed-precision", "--seed", "--log-every", "--eval-every", "--save-every",
                     "--keep-checkpoints", "--resume", "--tensorboard", "--dist-timeout"):
            assert flag in text, (recipe.__name__, flag)
        assert "newest checkpoints kept on disk" in text  # an inherited field's docstring is its help
    assert (mtpc.parse_args([]).lr, mtpc.parse_args([]).log_every) == (3e-4, 10)
    assert (byte_lm.parse_args([]).lr_decay, byte_lm.parse_args([]).decay_steps) == ("cosine", -1)
    assert gated_lora.parse_args([]).lr == 2e-4
    for argv, needle in ((["--mixed-precision", "fp8"], "--mixed-precision"), (["--lr-decay", "step"], "--lr-decay"),
                         (["--max-steps", "10", "--decay-steps", "11"], "--decay-steps")):
        with pytest.raises(SystemExit):
            gated_lora.parse_args(argv)
        assert needle in capsys.readouterr().err


def test_lr_schedule_warms_up_stays_flat_then_decays():
    flat = [lr_multiplier(s, 10, warmup_steps=2) for s in range(10)]
    assert flat == [0.5] + [1.0] * 9
    wsd = [lr_multiplier(s, 10, warmup_steps=2, decay_steps=4, min_lr_ratio=0.2) for s in range(10)]
    assert wsd[:6] == [0.5] + [1.0] * 5
    assert wsd[6:] == pytest.approx([0.8, 0.6, 0.4, 0.2])
    cosine = [lr_multiplier(s, 10, warmup_steps=2, decay_steps=-1, min_lr_ratio=0.1, decay="cosine") for s in range(10)]
    assert cosine[:3] == [0.5, 1.0, 1.0 - 0.9 * 0.5 * (1 - math.cos(math.pi / 8))]
    assert all(a > b for a, b in zip(cosine[2:], cosine[3:])) and cosine[-1] == pytest.approx(0.1)
    # a time budget further along than the steps pulls the decay forward
    assert lr_multiplier(3, 10, 2, -1, 0.1, "cosine", progress=1.0) == pytest.approx(0.1)
    assert lr_multiplier(3, 10, 2, -1, 0.1, "cosine", progress=0.1) == cosine[3]


class OneProcess:
    device = torch.device("cpu")

    @staticmethod
    def reduce(tensor, reduction):
        return tensor


def test_window_means_totals_and_nan():
    window = engine.Window(OneProcess())
    window.add(loss=torch.tensor(2.0), acc=math.nan, per_offset=torch.tensor([1.0, 3.0]))
    window.add(loss=torch.tensor(4.0), acc=0.5, per_offset=torch.tensor([3.0, math.nan]))
    window.count(bytes=10)
    window.count(bytes=torch.tensor(5))
    means, totals, seconds = window.reduce()
    assert means == {"loss": 3.0, "acc": 0.5, "per_offset": [2.0, 3.0]} and totals == {"bytes": 15.0}
    assert seconds >= 0 and window.reduce()[0] == {}  # the next window starts empty


def test_an_earlier_mtpc_checkpoint_cannot_resume_but_starts_a_run(tmp_path, capsys):
    """The earlier MTPC layout: head.safetensors + optimizer.pt + mtpkit_config.json in checkpoint-N/."""
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"Add {i} and 1."},
                                                       {"role": "assistant", "content": f"{i + 1}. Done."}]})
                              for i in range(8)) + "\n")
    tiny = ["--backbone", "tiny-byte-llama-random", "--max-length", "64", "--windows-per-sequence", "4", "--arch", "cp",
            "-n", "4", "--rank", "3", "--eval-every", "0", "--data", str(data)]
    mtpc.main([*tiny, "--output-dir", str(tmp_path / "new"), "--max-steps", "1"])
    old = tmp_path / "old" / "checkpoint-1"
    old.mkdir(parents=True)
    for name in ("head.safetensors", "mtpkit_config.json"):
        shutil.copy(tmp_path / "new" / "checkpoint-1" / "head" / name, old / name)
    for name in ("trainer_state.json", "config.yaml"):
        shutil.copy(tmp_path / "new" / "checkpoint-1" / name, old / name)
    torch.save({"state": {}, "param_groups": []}, old / "optimizer.pt")

    with pytest.raises(SystemExit) as e:
        mtpc.main([*tiny, "--output-dir", str(tmp_path / "old"), "--max-steps", "2", "--resume", "auto"])
    message = str(e.value)
    assert "\n" not in message and str(old) in message and "earlier layout" in message
    assert f"--init-from {old}" in message
    capsys.readouterr()
    mtpc.main([*tiny, "--output-dir", str(tmp_path / "stage2"), "--max-steps", "1", "--init-from", str(old)])
    assert "[init]" in capsys.readouterr().out


def test_an_earlier_byte_lm_checkpoint_says_retrain(tmp_path):
    old = tmp_path / "run" / "checkpoint-4"
    old.mkdir(parents=True)
    (old / "trainer_state.json").write_text(json.dumps({"step": 4, "trained_seconds": 1.0}))
    for name in ("model.pt", "optimizer.pt"):
        torch.save({}, old / name)
    with pytest.raises(SystemExit) as e:
        byte_lm.main(["--output-dir", str(tmp_path / "run"), "--resume", "auto", "--stdlib-mb", "0"])
    message = str(e.value)
    assert "\n" not in message and str(old) in message and "model.pt" in message and "retrain" in message
    with pytest.raises(SystemExit, match="not a checkpoint"):
        byte_lm.main(["--output-dir", str(tmp_path / "run"), "--resume", str(tmp_path), "--stdlib-mb", "0"])
