"""What a run does to its output dir and to the files it replaces: a fresh run never mixes with
another run's files (refused, or --overwrite deletes them), config.yaml is written once the run
has started, pruning keeps the checkpoint just written, a non-finite loss stops the run (or is
skipped and counted), the byte LM installs atomically, export leaves files it did not write
alone, and a killed launcher takes its workers with it. On the tiny byte backbone."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mtpkit.train import byte_lm, checkpoints, export, mtpc


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "chat.jsonl"
    path.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"Add {i} and 1."},
                                                       {"role": "assistant", "content": f"{i + 1}. Done."}]})
                              for i in range(8)) + "\n")
    return path


def tiny(data, out, *more):
    return ["--backbone", "tiny-byte-llama-random", "--max-length", "64", "--windows-per-sequence", "4",
            "--arch", "cp", "-n", "4", "--rank", "3", "--eval-every", "0", "--data", str(data),
            "--output-dir", str(out), "--save-every", "1", "--log-every", "1", *more]


def steps(out: Path) -> list[int]:
    return [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def test_a_fresh_run_into_another_runs_dir_is_refused_or_overwritten(data, tmp_path):
    out = tmp_path / "run"
    mtpc.main(tiny(data, out, "--max-steps", "3"))
    (out / "notes.txt").write_text("mine")
    before = {p: p.read_bytes() for p in (out / "metrics.jsonl", out / "config.yaml")}
    with pytest.raises(SystemExit) as e:
        mtpc.main(tiny(data, out, "--max-steps", "2", "--lr", "1e-3"))
    assert "holds another run" in str(e.value) and "--overwrite 1" in str(e.value) and "\n" not in str(e.value)
    assert all(p.read_bytes() == b for p, b in before.items())  # nothing appended, nothing rewritten
    assert [c.name for c in checkpoints.checkpoints(out)] == ["checkpoint-2", "checkpoint-3"]

    mtpc.main(tiny(data, out, "--max-steps", "2", "--lr", "1e-3", "--overwrite", "1"))
    assert steps(out) == [1, 2]  # the old run's lines are gone, not mixed in
    assert [c.name for c in checkpoints.checkpoints(out)] == ["checkpoint-1", "checkpoint-2"]
    assert "lr: 0.001" in (out / "config.yaml").read_text() and (out / "notes.txt").read_text() == "mine"
    # --resume continues the run in place
    mtpc.main(tiny(data, out, "--max-steps", "3", "--lr", "1e-3", "--resume", "auto"))
    assert steps(out) == [1, 2, 3]


def test_a_failed_resume_leaves_config_yaml_untouched(data, tmp_path):
    out = tmp_path / "run"
    mtpc.main(tiny(data, out, "--max-steps", "1"))
    config = (out / "config.yaml").read_bytes()
    with pytest.raises(SystemExit) as e:  # another rank: the checkpoint's tensors do not fit
        mtpc.main(tiny(data, out, "--max-steps", "2", "--rank", "5", "--resume", "auto"))
    assert "does not fit" in str(e.value) and "\n" not in str(e.value)
    assert (out / "config.yaml").read_bytes() == config
    assert [c.name for c in checkpoints.checkpoints(out)] == ["checkpoint-1"]


def test_pruning_keeps_the_checkpoint_just_written(tmp_path):
    for step in (2, 3, 4):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / checkpoints.TRAINER_STATE).write_text(json.dumps({"step": step}))
    # resumed from checkpoint-2: checkpoint-3 is the current run's newest, checkpoint-4 the interrupted run's
    checkpoints.prune_checkpoints(tmp_path, 1, current=tmp_path / "checkpoint-3")
    assert [c.name for c in checkpoints.checkpoints(tmp_path)] == ["checkpoint-3"]
    checkpoints.prune_checkpoints(tmp_path, 0, current=tmp_path / "checkpoint-3")
    assert [c.name for c in checkpoints.checkpoints(tmp_path)] == ["checkpoint-3"]


def test_a_nonfinite_loss_stops_the_run_or_is_skipped(data, tmp_path, monkeypatch):
    real = mtpc.window_loss
    calls = []

    def loss_nan_on_step_2(*args, **kwargs):
        nll, per_offset = real(*args, **kwargs)
        calls.append(1)
        return (nll * float("nan") if len(calls) == 2 else nll), per_offset

    monkeypatch.setattr(mtpc, "window_loss", loss_nan_on_step_2)
    with pytest.raises(SystemExit) as e:
        mtpc.main(tiny(data, tmp_path / "stop", "--max-steps", "3"))
    assert "non-finite loss at optimizer step 2" in str(e.value) and "--nonfinite skip" in str(e.value)
    assert [c.name for c in checkpoints.checkpoints(tmp_path / "stop")] == ["checkpoint-1"]

    calls.clear()
    result = mtpc.main(tiny(data, tmp_path / "skip", "--max-steps", "3", "--nonfinite", "skip",
                            "--keep-checkpoints", "3"))
    rows = [json.loads(r) for r in (tmp_path / "skip" / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_steps"] for r in rows] == [0, 1, 0] and result["step"] == 3
    one, two = (load_file(str(tmp_path / "skip" / f"checkpoint-{s}" / "head" / "head.safetensors")) for s in (1, 2))
    for name in one:  # the skipped step changed no weight, and none is NaN
        assert torch.equal(one[name], two[name]) and torch.isfinite(two[name]).all(), name


def test_a_huge_learning_rate_never_saves_nan_weights(data, tmp_path):
    with pytest.raises(SystemExit) as e:
        mtpc.main(tiny(data, tmp_path / "run", "--max-steps", "4", "--lr", "1e30", "--max-grad-norm", "0"))
    assert "non-finite" in str(e.value)
    for ckpt in checkpoints.checkpoints(tmp_path / "run"):
        for name, t in load_file(str(ckpt / "head" / "head.safetensors")).items():
            assert torch.isfinite(t).all(), (ckpt, name)


def test_nan_weights_are_never_saved(data, tmp_path, monkeypatch):
    """An update that leaves NaN weights (a finite loss before it): the checkpoint is refused,
    naming the tensor, and nothing of it is written."""
    real = torch.optim.AdamW.step

    def step_to_nan(self, *args, **kwargs):
        real(self, *args, **kwargs)
        with torch.no_grad():
            self.param_groups[0]["params"][0].view(-1)[0] = float("nan")

    monkeypatch.setattr(torch.optim.AdamW, "step", step_to_nan)
    with pytest.raises(SystemExit) as e:
        mtpc.main(tiny(data, tmp_path / "run", "--max-steps", "1"))
    assert "not saving" in str(e.value) and "checkpoint-1" in str(e.value) and "non-finite" in str(e.value)
    assert not (tmp_path / "run" / "checkpoint-1").exists()


def test_byte_lm_install_swaps_the_folder_in_whole(tmp_path, monkeypatch):
    new, target = tmp_path / "model", tmp_path / "cache" / "mtpkit-byte-lm"
    new.mkdir()
    (new / "config.json").write_text("new")
    target.mkdir(parents=True)
    (target / "config.json").write_text("old")
    (target / "stale.bin").write_text("old")
    real = byte_lm.shutil.copytree

    def dies_half_way(src, dst, **kw):
        Path(dst).mkdir()
        raise OSError("disk full")

    monkeypatch.setattr(byte_lm.shutil, "copytree", dies_half_way)
    with pytest.raises(OSError):
        byte_lm.install(new, target)
    assert (target / "config.json").read_text() == "old" and sorted(p.name for p in target.parent.iterdir()) == [
        "mtpkit-byte-lm"]  # the installed model untouched, no temporary folder left
    monkeypatch.setattr(byte_lm.shutil, "copytree", real)
    byte_lm.install(new, target)
    assert sorted(p.name for p in target.iterdir()) == ["config.json"] and (target / "config.json").read_text() == "new"
    assert sorted(p.name for p in target.parent.iterdir()) == ["mtpkit-byte-lm"]


def test_export_never_overwrites_files_it_did_not_write(data, tmp_path, capsys):
    mtpc.main(tiny(data, tmp_path / "run", "--max-steps", "1"))
    out = tmp_path / "folder"
    out.mkdir()
    (out / "README.md").write_text("my own notes")
    with pytest.raises(SystemExit) as e:
        export.main(["--checkpoint", str(tmp_path / "run"), "--out", str(out)])
    assert "README.md" in str(e.value) and "--overwrite" in str(e.value)
    assert (out / "README.md").read_text() == "my own notes" and sorted(p.name for p in out.iterdir()) == ["README.md"]
    export.main(["--checkpoint", str(tmp_path / "run"), "--out", str(out), "--overwrite"])
    assert "MTPC" in (out / "README.md").read_text()
    export.main(["--checkpoint", str(tmp_path / "run"), "--out", str(out)])  # an earlier export: replaced
    (out / "extra.txt").write_text("mine")
    with pytest.raises(SystemExit, match="extra.txt"):
        export.main(["--checkpoint", str(tmp_path / "run"), "--out", str(out)])


def test_export_refuses_nonfinite_weights(data, tmp_path):
    from safetensors.torch import save_file

    mtpc.main(tiny(data, tmp_path / "run", "--max-steps", "1"))
    file = tmp_path / "run" / "checkpoint-1" / "head" / "head.safetensors"
    tensors = load_file(str(file))
    name = sorted(tensors)[0]
    tensors[name] = torch.full_like(tensors[name], float("inf"))
    save_file(tensors, str(file))
    with pytest.raises(SystemExit) as e:
        export.main(["--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "export")])
    assert str(file) in str(e.value) and repr(name) in str(e.value)
    assert not (tmp_path / "export").exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")
def test_a_worker_dies_with_its_launcher(tmp_path):
    """A parent (the launcher) starts a worker that calls output_dir.die_with_parent(), then is
    killed with SIGKILL (it cannot pass anything on): the kernel ends the worker."""
    worker = ("import sys, time\nfrom mtpkit.train.output_dir import die_with_parent\ndie_with_parent()\n"
              "print('ready', flush=True)\ntime.sleep(120)\n")
    parent = ("import subprocess, sys, time\n"
              f"child = subprocess.Popen([sys.executable, '-c', {worker!r}], stdout=subprocess.PIPE)\n"
              "child.stdout.readline()\nprint(child.pid, flush=True)\ntime.sleep(120)\n")
    launcher = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    child = int(launcher.stdout.readline())
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait()
    deadline = time.time() + 10
    while time.time() < deadline and Path(f"/proc/{child}").exists() and "Z" not in _state(child):
        time.sleep(0.1)
    alive = Path(f"/proc/{child}").exists() and "Z" not in _state(child)
    if alive:
        os.kill(child, signal.SIGKILL)
    assert not alive


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0]
    except (OSError, IndexError):
        return "Z"
