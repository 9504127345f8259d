"""What keeps a run's files whole when something else goes wrong: `--resume auto` steps
past a corrupt newest checkpoint, two runs never share one output dir (a lock; the second is
refused at once), a --dtype the device cannot train is refused before anything is written,
export checks --results first and swaps its folder in whole, a misplaced YAML key says where it
belongs, and MTPC draws its metrics.png. On the tiny random backbones."""

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mtpkit.train import checkpoints, export, gated_lora, mtpc
# the same 8-record MTPC run on the tiny byte backbone as test_outputs.py: its `data` fixture and flags
from test_outputs import data, tiny  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]


def losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


# --- resume past a corrupt checkpoint ---------------------------------------------------------

@pytest.mark.parametrize("broken", ["state/model.safetensors", "trainer_state.json"])
def test_resume_auto_skips_a_corrupt_newest_checkpoint(data, tmp_path, capsys, broken):
    """checkpoint-2's file cut in half (a disk filled, a copy interrupted): `--resume auto` says
    it skips it and why, resumes from checkpoint-1, and logs the same losses as a run straight
    through."""
    mtpc.main(tiny(data, tmp_path / "straight", "--max-steps", "3"))
    out = tmp_path / "run"
    mtpc.main(tiny(data, out, "--max-steps", "2"))
    truncate(out / "checkpoint-2" / broken)
    capsys.readouterr()
    mtpc.main(tiny(data, out, "--max-steps", "3", "--resume", "auto"))
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[resume] skipping")]
    assert len(said) == 1 and str(out / "checkpoint-2" / broken) in said[0], said
    assert losses(out) == losses(tmp_path / "straight")
    assert [c.name for c in checkpoints.checkpoints(out)] == ["checkpoint-2", "checkpoint-3"]


def test_a_resume_with_no_readable_checkpoint_is_refused_naming_the_file(data, tmp_path):
    out = tmp_path / "run"
    mtpc.main(tiny(data, out, "--max-steps", "2"))
    truncate(out / "checkpoint-2" / "state" / "optimizer.safetensors")
    (out / "checkpoint-1" / "state" / "optimizer.json").write_text('{"state": ')
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".mtpkit.lock"}
    with pytest.raises(SystemExit) as e:  # an explicit corrupt checkpoint: no fallback
        mtpc.main(tiny(data, out, "--max-steps", "3", "--resume", str(out / "checkpoint-2")))
    assert str(out / "checkpoint-2" / "state" / "optimizer.safetensors") in str(e.value)
    assert "\n" not in str(e.value)
    with pytest.raises(SystemExit) as e:  # auto: every checkpoint unreadable
        mtpc.main(tiny(data, out, "--max-steps", "3", "--resume", "auto"))
    assert "checkpoint-1" in str(e.value) and "checkpoint-2" in str(e.value) and "\n" not in str(e.value)
    after = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".mtpkit.lock"}
    assert after == before  # nothing written, nothing moved


# --- one run per output dir -------------------------------------------------------------------

def gated_lora_command(data, out, *more):
    return [sys.executable, "train/gated_lora.py", "--backbone", "tiny-llama-random", "--data", str(data), "--k", "2",
            "--rank", "4", "--max-length", "64", "--eval-every", "0", "--save-every", "2", "--device", "cpu",
            "--output-dir", str(out), *more]


def test_two_trainers_into_one_output_dir_the_second_is_refused_at_once(data, tmp_path):
    """Two real gated_lora.py processes into one folder, started together (their imports overlap):
    the first to take the lock is paused by SIGSTOP the moment its pid is in the lock file, so the
    overlap does not depend on the machine's speed; the other is refused with one line naming the
    first's pid, without waiting for it; the first, let go on, logs each step once and its
    config.yaml is its own (its --lr)."""
    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH="")
    lrs = ("0.001", "0.002")
    procs = [subprocess.Popen(gated_lora_command(data, out, "--max-steps", "8", "--lr", lr), cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for lr in lrs]
    lock, deadline, first = out / ".mtpkit.lock", time.time() + 300, None
    try:
        while first is None and time.time() < deadline and any(p.poll() is None for p in procs):
            holder = lock.read_text().strip() if lock.exists() else ""
            first = next((p for p in procs if holder == str(p.pid)), None)
            if first is None:
                time.sleep(0.01)
        assert first is not None and first.poll() is None, [p.communicate()[1][-2000:] for p in procs]
        os.kill(first.pid, signal.SIGSTOP)  # it holds the lock and cannot end while the other starts
        second = next(p for p in procs if p is not first)
        _, second_err = second.communicate(timeout=300)
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
    _, first_err = first.communicate(timeout=600)
    assert first.returncode == 0, first_err[-2000:]
    assert second.returncode != 0 and "Traceback" not in second_err, second_err[-3000:]
    message = second_err.strip().splitlines()[-1]
    assert f"pid {first.pid}" in message and str(out) in message, message
    assert [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())] == list(range(1, 9))
    assert [c.name for c in checkpoints.checkpoints(out)] == ["checkpoint-6", "checkpoint-8"]
    lr = lrs[procs.index(first)]
    assert f"lr: {lr}" in (out / "config.yaml").read_text()
    assert f"lr: {lr}" in (out / "checkpoint-8" / "config.yaml").read_text()


def hold_lock(out: Path) -> subprocess.Popen:
    """A process that holds out/.mtpkit.lock as a living run does (its pid written there)."""
    out.mkdir(parents=True, exist_ok=True)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(out / '.mtpkit.lock')!r}, os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\nos.ftruncate(fd, 0)\nos.write(fd, str(os.getpid()).encode())\n"
        "print('locked', flush=True)\ntime.sleep(300)\n")], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_every_process_of_a_launch_learns_the_refusal(data, tmp_path):
    """Two processes (accelerate launch, CPU DDP) into a folder another run holds: the main
    process's refusal reaches the other through the process group; both exit with the one line,
    and no process waits for a collective that never comes."""
    out = tmp_path / "run"
    holder = hold_lock(out)
    try:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "configs/accelerate/cpu_ddp.yaml",
               *gated_lora_command(data, out, "--max-steps", "2", "--dist-timeout", "60")[1:]]
        proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1", ACCELERATE_DISABLE_RICH="1",
                                                      PYTHONPATH=""), capture_output=True, text=True, timeout=300)
    finally:
        holder.kill()
        holder.wait()
    # one from each process (the two may share a line of stderr: both write at the same moment)
    refusals = proc.stderr.count(f"is in use by another run (pid {holder.pid} holds")
    assert proc.returncode != 0 and refusals == 2, proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == [".mtpkit.lock"]


def test_a_locked_output_dir_refuses_every_mode_and_an_ended_run_lets_go(data, tmp_path):
    """Another process holds the folder's lock: a fresh run, --resume auto and --overwrite 1 are
    all refused before they write, naming its pid; an in-process run that ended with an error
    leaves the folder free for the next."""
    out = tmp_path / "run"
    mtpc.main(tiny(data, out, "--max-steps", "1"))
    holder = hold_lock(out)
    try:
        before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
        for more in ([], ["--resume", "auto"], ["--overwrite", "1"]):
            with pytest.raises(SystemExit) as e:
                mtpc.main(tiny(data, out, "--max-steps", "2", *more))
            assert f"pid {holder.pid}" in str(e.value) and "\n" not in str(e.value), more
        assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    finally:
        holder.kill()
        holder.wait()
    with pytest.raises(SystemExit, match="does not fit"):  # fails after it took the lock
        mtpc.main(tiny(data, out, "--max-steps", "2", "--rank", "5", "--resume", "auto"))
    mtpc.main(tiny(data, out, "--max-steps", "2", "--resume", "auto"))
    assert sorted(losses(out)) == [1, 2]
    fd = os.open(out / ".mtpkit.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the finished run let go
    finally:
        os.close(fd)


# --- dtypes the device cannot train -----------------------------------------------------------

def test_float16_on_a_cpu_is_refused_before_anything_is_written(data, tmp_path, capsys, monkeypatch):
    """Gated LoRA over a float16 backbone needs float16 autocast, which a CPU lacks (accelerate
    drops it there): refused at the flags, naming --dtype and what works. MTPC's model casts its
    float32 head's inputs itself, so it trains a float16 backbone on a CPU and is not refused;
    --mixed-precision fp16 on a CPU, which would silently run without autocast, is refused for both."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "run"
    for device in ("cpu", "auto"):
        with pytest.raises(SystemExit) as e:
            gated_lora.main(["--backbone", "tiny-llama-random", "--data", str(data), "--k", "2", "--rank", "4",
                             "--max-steps", "1", "--eval-every", "0", "--output-dir", str(out), "--dtype", "float16",
                             "--device", device])
        assert e.value.code == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
        assert len(errors) == 1 and all(w in errors[0] for w in ("--dtype", "float32", "bfloat16")), errors
        assert not out.exists()
    assert gated_lora.parse_args(["--dtype", "bfloat16", "--device", "cpu"]).dtype == "bfloat16"
    assert gated_lora.parse_args(["--dtype", "float16", "--device", "cuda"]).dtype == "float16"  # a GPU's: allowed
    assert mtpc.parse_args(["--dtype", "float16", "--device", "cpu"]).dtype == "float16"
    # --mixed-precision fp16 on a CPU would run without autocast (accelerate drops it there): refused
    for recipe in (gated_lora, mtpc):
        with pytest.raises(SystemExit):
            recipe.parse_args(["--mixed-precision", "fp16", "--device", "cpu"])
        errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
        assert len(errors) == 1 and "--mixed-precision must be auto, no or bf16 on a CPU" in errors[0], errors


# --- export -----------------------------------------------------------------------------------

def test_export_checks_results_first_and_swaps_its_folder_in_whole(data, tmp_path, monkeypatch):
    mtpc.main(tiny(data, tmp_path / "run", "--max-steps", "1"))
    argv = ["--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "export")]
    bad = tmp_path / "results.json"
    bad.write_text(json.dumps({"config": {"data": ["builtin"]}}))
    with pytest.raises(SystemExit) as e:
        export.main([*argv, "--results", str(bad)])
    assert str(bad) in str(e.value) and "'methods'" in str(e.value) and "\n" not in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json", "run"]  # nothing written

    export.main(argv)  # an earlier export, then a failure while the card is built: the folder as it was
    before = {p.name: p.read_bytes() for p in (tmp_path / "export").iterdir()}

    def broken_card(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(export, "model_card", broken_card)
    with pytest.raises(OSError, match="disk full"):
        export.main(argv)
    assert {p.name: p.read_bytes() for p in (tmp_path / "export").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "results.json", "run"]  # no temporary folder left
    monkeypatch.undo()

    (tmp_path / "export" / "notes.txt").write_text("mine")
    good = {"methods": {"ar": {"tau": 1.0, "tokens_per_s": 50.0, "speedup_vs_ar": 1.0, "matches_ar": True,
                               "per_category": {"chat": {"tau": 1.0, "speedup_vs_ar": 1.0}}}},
            "categories": ["chat"]}
    bad.write_text(json.dumps(good))
    export.main([*argv, "--results", str(bad), "--overwrite"])
    assert "| ar | 1.00 |" in (tmp_path / "export" / "README.md").read_text()
    assert (tmp_path / "export" / "notes.txt").read_text() == "mine"  # --overwrite leaves the others
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "results.json", "run"]

    state = tmp_path / "run" / "checkpoint-1" / "trainer_state.json"
    truncate(state)
    with pytest.raises(SystemExit) as e:
        export.main([*argv, "--overwrite"])
    assert str(state) in str(e.value) and "\n" not in str(e.value)


# --- config hints and MTPC's plot -------------------------------------------------------------

def test_a_model_key_at_the_top_level_says_where_it_belongs(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("max_steps: 3\nk: 2\n")
    with pytest.raises(SystemExit):
        gated_lora.parse_args(["--config", str(path)])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "['k']" in errors[0] and "model.k" in errors[0], errors


def test_mtpc_draws_metrics_png(data, tmp_path):
    mtpc.main(tiny(data, tmp_path / "run", "--max-steps", "2"))
    png = tmp_path / "run" / "metrics.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
