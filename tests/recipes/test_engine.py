"""What the three recipes share (train/engine.py, train/schedule.py, train/checkpoints.py): the
config fields and every YAML in configs/, the learning-rate schedule, the log window, and what
`--resume` says to a checkpoint of the earlier layouts."""

import io
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from mtpkit.train import byte_lm, engine, gated_lora, mtpc, recipe_config
from mtpkit.train.schedule import lr_multiplier

ROOT = Path(__file__).resolve().parents[2]
RECIPES = {"gated_lora": gated_lora, "mtpc": mtpc, "byte_lm": byte_lm}


@pytest.mark.parametrize("path", sorted(p.relative_to(ROOT) for p in ROOT.glob("configs/*/*.yaml")
                                        if p.parent.name in RECIPES), ids=str)
def test_every_recipe_config_parses(path):
    cfg = RECIPES[path.parent.name].parse_args(["--config", str(ROOT / path)])
    assert isinstance(cfg, recipe_config.TrainArgs) and cfg.output_dir.startswith("runs/")
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


def test_print_config_prints_the_resolved_config_and_exits(capsys):
    """--print-config: the config after defaults, YAML, flags and the recipe's own defaults (MTPC's
    gamma from n), one JSON line, exit 0 (what eval/ablate.py reads); a bad flag is still refused.
    The head recipes' shared fields are declared once (HeadTrainArgs), their defaults their own."""
    with pytest.raises(SystemExit) as e:
        mtpc.parse_args(["--print-config", "--n", "16", "--arch", "cp"])
    assert e.value.code == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["model"]["n"] == 16 and printed["gamma"] == 0.9 and printed["backbone"] == "mtpkit-byte-lm"
    with pytest.raises(SystemExit) as e:
        gated_lora.parse_args(["--print-config", "--k", "0"])
    assert e.value.code == 2 and "--k" in capsys.readouterr().err
    for recipe in (gated_lora, mtpc):
        assert issubclass(recipe.TrainConfig, recipe_config.HeadTrainArgs)
        assert "trust_remote_code" not in vars(recipe.TrainConfig).get("__annotations__", {})
    assert (gated_lora.parse_args([]).max_length, mtpc.parse_args([]).max_length) == (384, 1024)


def test_print_configs_resolves_each_argument_list_of_stdin(capsys, monkeypatch):
    """--print-configs alone: one JSON line per argument list of the JSON list on stdin, the
    resolved config or the one line the trainer refuses it with; exit 0 (eval/ablate.py's one
    process for all its variants)."""
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps([["--k", "3"], ["--k", "0"], ["--rank", "x"]])))
    with pytest.raises(SystemExit) as e:
        gated_lora.parse_args(["--print-configs"])
    assert e.value.code == 0
    ok, bad_k, bad_rank = map(json.loads, capsys.readouterr().out.strip().splitlines())
    assert ok["model"]["k"] == 3
    assert set(bad_k) == {"error"} and "--k" in bad_k["error"] and "\n" not in bad_k["error"]
    assert set(bad_rank) == {"error"} and "--rank" in bad_rank["error"]


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


def test_device_flag_is_checked_before_anything_loads(monkeypatch):
    assert engine.train_device("cpu", 1, deepspeed=False) == torch.device("cpu")
    with pytest.raises(SystemExit, match="names one GPU, but 2 processes run"):
        engine.train_device("cuda:1", 2, deepspeed=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert engine.train_device("auto", 1, deepspeed=False) == torch.device("cpu")
    with pytest.raises(SystemExit, match="no CUDA device is visible"):
        engine.train_device("cuda", 1, deepspeed=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit, match="--device cpu under DeepSpeed"):
        engine.train_device("cpu", 2, deepspeed=True)
    for argv, needle in ((["--device", "gpu"], "--device must be auto|cpu|cuda|cuda:N"),
                         (["--dtype", "int8"], "--dtype must be one of auto")):
        with pytest.raises(SystemExit):
            gated_lora.parse_args(argv)
    # the YAML key `dtype` (a recipe field before, the engine's now) still reads
    assert mtpc.parse_args(["--config", str(ROOT / "configs/mtpc/evabyte-6.5b_btree_n16_heads.yaml")]).dtype == "bfloat16"
    assert mtpc.parse_args([]).dtype == "auto" and gated_lora.parse_args(["--dtype", "fp32"]).dtype == "fp32"


def test_autocast_follows_a_half_precision_backbone_unless_told():
    assert engine.autocast_precision("auto", torch.float32) == "no"
    assert engine.autocast_precision("auto", torch.bfloat16) == "bf16"
    assert engine.autocast_precision("auto", torch.float16) == "fp16"
    assert engine.autocast_precision("bf16", torch.float32) == "bf16"
    with pytest.raises(SystemExit, match="--mixed-precision no with a bfloat16 backbone"):
        engine.autocast_precision("no", torch.bfloat16)


def test_a_bfloat16_backbone_trains_float32_parameters(tmp_path, capsys):
    """--dtype bfloat16 on the CPU: the backbone is bfloat16, the forward runs under bf16 autocast,
    and the trained LoRA, mask embeddings and sampler stay (and are saved) float32. In this
    process, with accelerate's state cleared before and after: that state, fixed by the first
    Accelerator of a process, would otherwise keep an earlier test's mixed precision (and hand
    this run's bf16 on to the next test)."""
    from accelerate.state import AcceleratorState, GradientState
    from safetensors.torch import load_file

    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"Add {i} and 1."},
                                                       {"role": "assistant", "content": f"{i + 1}. Done."}]})
                              for i in range(8)) + "\n")
    out = tmp_path / "run"

    def fresh_state():
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()

    fresh_state()
    try:
        gated_lora.main(["--backbone", "tiny-llama-random", "--data", str(data), "--k", "2", "--rank", "4",
                         "--max-length", "64", "--max-steps", "2", "--eval-every", "0", "--device", "cpu",
                         "--dtype", "bfloat16", "--output-dir", str(out)])
    finally:
        fresh_state()
    assert "cpu, backbone bfloat16" in capsys.readouterr().out
    assert "mixed_precision: auto" in (out / "config.yaml").read_text()
    for name in ("adapter_model.safetensors", "mtp_head.safetensors"):
        tensors = load_file(str(out / "checkpoint-2" / "head" / name))
        assert tensors and {t.dtype for t in tensors.values()} == {torch.float32}, name
