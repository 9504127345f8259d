"""The output dir of a run: one run at a time (an exclusive lock, `lock_output_dir`), another
run's files refused or deleted on request (`claim_output_dir`), and a launched worker that dies
with its launcher (`die_with_parent`), so nothing writes to the folder once the run is gone."""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

RUN_FILES = ("config.yaml", "metrics.jsonl", "metrics.superseded.jsonl", "metrics.png", "tensorboard", "model",
             "eval.json")
"""what a recipe writes to output_dir besides checkpoint-N/ (model/ and eval.json: byte_lm)"""
LOCK = ".mtpkit.lock"
"""output_dir/LOCK: the file a living run holds locked (flock), holding its main process's pid"""


def _say(accelerator):
    """print() of the main process (through tqdm, so progress bars stay intact)."""
    return (lambda msg: tqdm.write(msg)) if accelerator.is_main_process else (lambda msg: None)


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Linux: have the kernel send `sig` to this process when its parent dies (prctl
    PR_SET_PDEATHSIG), so a killed torchrun or accelerate launcher leaves no worker writing to the
    output dir. Elsewhere, nothing."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(sig), 0, 0, 0)


_held: dict[Path, int] = {}
"""the output dirs whose LOCK this process holds: resolved folder -> open file descriptor"""


def lock_output_dir(accelerator, cfg) -> None:
    """The run's hold on output_dir (every mode: fresh, --resume, --overwrite): the main process
    creates output_dir and takes an exclusive, non-blocking flock on output_dir/LOCK, writes its pid
    there, and keeps it until `finish` (or its exit: the kernel lets go of a dead process's lock).
    When another process holds it, the run is refused at once (SystemExit on every process: the
    main process's answer goes to all), naming the holder's pid. The lock file is never deleted
    (a run deleting it could let two later runs lock two different files).
    A lock still held by this process (an earlier in-process run, e.g. a test's `main()`, that
    ended with an error before `finish`) is that ended run's: it is let go first. On a file system
    without locks the run goes on unlocked, saying so; a folder that cannot be created or opened
    is refused."""
    out, holder, problem = Path(cfg.output_dir), 0, ""
    if accelerator.is_main_process:
        try:
            holder = _lock(out)
        except OSError as e:
            if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                _say(accelerator)(f"[lock] {out / LOCK}: the file system takes no locks ({e.strerror}); a second "
                                     "run into this folder would not be refused")
            else:
                holder, problem = -2, f"cannot lock {out / LOCK} ({e.strerror or e})"
    if accelerator.num_processes > 1:  # the main process's answer, to every process
        holder = int(accelerator.reduce(torch.tensor([holder], device=accelerator.device), reduction="sum").item())
    if holder == -2:
        raise SystemExit(f"error: --output-dir {out}: {problem or 'the main process cannot lock ' + str(out / LOCK)}")
    if holder:
        who = f"pid {holder}" if holder > 0 else "a process that did not write its pid"
        raise SystemExit(f"error: --output-dir {out} is in use by another run ({who} holds {out / LOCK}); wait "
                         "for it to end, or choose another --output-dir")


def _lock(out: Path) -> int:
    """0 once this process holds out/LOCK; else the holder's pid (-1: not written)."""
    out.mkdir(parents=True, exist_ok=True)
    key = out.resolve()
    stale = _held.pop(key, None)
    if stale is not None:
        os.close(stale)
    fd = os.open(key / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            for _ in range(20):  # the holder writes its pid right after it locks
                text = os.pread(fd, 32, 0).decode(errors="replace").strip()
                if text.isdigit():
                    return int(text)
                time.sleep(0.01)
            return -1
        finally:
            os.close(fd)
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    _held[key] = fd
    return 0


def unlock_output_dir(out) -> None:
    """Let go of the lock this process holds on `out` (nothing when it holds none)."""
    fd = _held.pop(Path(out).resolve(), None)
    if fd is not None:
        os.close(fd)


def claim_output_dir(accelerator, cfg) -> None:
    """A fresh run (no --resume) into an output_dir that holds another run (checkpoint-N/,
    metrics.jsonl or config.yaml): refused (SystemExit on every process) unless --overwrite,
    which deletes that run's files (checkpoint-N/ and RUN_FILES; other files stay)."""
    out = Path(cfg.output_dir)
    found = sorted(p.name for p in out.glob("checkpoint-*") if p.is_dir())
    found += [name for name in ("metrics.jsonl", "config.yaml") if (out / name).exists()]
    if not found or cfg.resume:
        return
    if not cfg.overwrite:
        raise SystemExit(f"error: --output-dir {out} holds another run ({', '.join(found[:4])}); continue it with "
                         "--resume auto, replace it with --overwrite 1 (deletes its files), or choose another "
                         "--output-dir")
    accelerator.wait_for_everyone()  # every process has looked before anything goes
    if accelerator.is_main_process:
        for path in [*out.glob("checkpoint-*"), *(out / name for name in RUN_FILES)]:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.exists() or path.is_symlink():
                path.unlink()
        _say(accelerator)(f"[overwrite] {out}: the earlier run's files deleted ({', '.join(found[:4])})")
    accelerator.wait_for_everyone()
