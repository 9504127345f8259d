"""The one checkpoint layout of every recipe, and resuming from it.

    OUTPUT_DIR/checkpoint-N/
        trainer_state.json   step, micro_step and the recipe's counters (written last: a folder
                             without it is incomplete and never resumed)
        config.yaml          the resolved config and the command that ran it
        head/                what the run trained, loadable on its own (a method's head folder,
                             or byte_lm's Hugging Face model folder)
        state/               what a resume needs, as tensors and JSON only (no pickle):
            model.safetensors              the trainable tensors (frozen backbones are re-read)
            optimizer.safetensors + .json  the optimizer's tensors; its param groups and scalars
            rng_R.json + rng_R.safetensors the random generators of process R (python, numpy,
                                           torch CPU and CUDA)
            scaler.json                    the fp16 loss scaler, when there is one
        (DeepSpeed: state/ is accelerate's save_state, DeepSpeed's own pickled shards.)

The learning-rate schedule is not saved: it is rebuilt from trainer_state's step. A resume loads
state/ into the prepared model and optimizer and moves the metric lines logged after the
checkpoint's step aside, so an interrupted and resumed run logs the same losses as one that ran
straight through. Its files are checked first (`unreadable`): `--resume auto` steps past a newest
checkpoint cut short (a full disk, an interrupted copy) to the one before, saying which and why.
A pickled state/ (DeepSpeed's, or one of the earlier accelerate layout: optimizer.bin,
random_states_R.pkl) can run code when loaded: it resumes only with --trust-checkpoint 1. No
checkpoint with non-finite trainable weights is written.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from mtpkit.data.jsonl import read_jsonl
from mtpkit.models.atomic_write import write_atomic
from mtpkit.models.head_folder import check_finite

TRAINER_STATE = "trainer_state.json"
STATE = "state"
HEAD = "head"
SAFE_STATE = "optimizer.json"
"""the file that marks a state/ of tensors and JSON (written by `save_state` below)"""


def checkpoints(output_dir: Path) -> list[Path]:
    """checkpoint-N/ folders with a trainer_state.json (i.e. complete), oldest first."""
    found = Path(output_dir).glob(f"checkpoint-*/{TRAINER_STATE}")
    return [p.parent for p in sorted(found, key=lambda p: _step(p.parent))]


def _step(folder: Path) -> int:
    try:
        return int(folder.name.split("-", 1)[1])
    except (IndexError, ValueError):
        return -1


def latest_checkpoint(output_dir: Path) -> Path | None:
    done = checkpoints(output_dir)
    return done[-1] if done else None


def resume_folder(cfg, old_layout: str = "", deepspeed: bool = False, log=None) -> Path | None:
    """`--resume`: '' = none, `auto` = the newest readable checkpoint in output_dir, else the folder
    given. Refuses (SystemExit, one line) before any model is loaded: a folder that is not a
    checkpoint, one of an earlier layout (`old_layout` says what to do; `{folder}` in it is the
    folder), a pickled state/ (DeepSpeed's or accelerate's) without --trust-checkpoint 1, a state/
    that the run's distributed stack cannot read (`deepspeed`: this run uses DeepSpeed), and one
    with a file that cannot be read whole (`unreadable`). `auto` steps past such unreadable
    checkpoints to the newest readable one, saying through `log` which it skipped and why; when
    every one is unreadable it refuses. Every process decides alike (it reads the same files)."""
    if not cfg.resume:
        return None
    if cfg.resume != "auto":
        folder = Path(cfg.resume)
        _check_layout(folder, cfg, old_layout, deepspeed)
        problem = unreadable(folder)
        if problem:
            raise SystemExit(f"--resume {folder}: {problem}; resume from another checkpoint (--resume auto takes "
                             "the newest readable one)")
        return folder
    skipped = []
    for folder in reversed(checkpoints(Path(cfg.output_dir))):
        _check_layout(folder, cfg, old_layout, deepspeed)
        problem = unreadable(folder)
        if problem is None:
            if skipped and log is not None:
                log(f"[resume] skipping {len(skipped)} unreadable checkpoint(s): {'; '.join(skipped)}; resuming "
                    f"from {folder}")
            return folder
        skipped.append(problem)
    if skipped:
        raise SystemExit(f"--resume auto: no checkpoint in {cfg.output_dir} can be read whole ({'; '.join(skipped)}); "
                         "start anew with --overwrite 1, or into another --output-dir")
    return None


def _check_layout(folder: Path, cfg, old_layout: str, deepspeed: bool) -> None:
    """resume_folder's refusals of a folder that this run cannot resume whatever its files hold."""
    if not (folder / TRAINER_STATE).is_file():
        raise SystemExit(f"--resume {folder}: not a checkpoint (no {TRAINER_STATE})")
    state = folder / STATE
    if not state.is_dir():
        files = ", ".join(sorted(p.name for p in folder.iterdir() if p.is_file()))
        raise SystemExit(f"--resume {folder}: a checkpoint of an earlier layout ({files}; no {STATE}/ folder) "
                         f"that this version cannot resume; {old_layout.format(folder=folder)}")
    if (state / SAFE_STATE).is_file():
        if deepspeed:
            raise SystemExit(f"--resume {folder}: a checkpoint of a run without DeepSpeed; a DeepSpeed run resumes "
                             "only its own checkpoints (start a new run, or resume without DeepSpeed)")
        return
    if not getattr(cfg, "trust_checkpoint", False):
        kind = "DeepSpeed's" if (state / "pytorch_model").is_dir() else "accelerate's (an earlier layout)"
        raise SystemExit(f"--resume {folder}: its {STATE}/ is {kind} pickled state, and unpickling can run code; "
                         "pass --trust-checkpoint 1 only if you wrote it yourself")


def unreadable(folder: Path) -> str | None:
    """The first file of checkpoint `folder` that a resume reads and that cannot be read whole (cut
    short by a full disk or an interrupted copy, or garbled), as "PATH cannot be read (why)"; None
    when all can. Checked without loading a tensor: trainer_state.json parses with its step; a
    state/ of `save_state` has model.safetensors, optimizer.safetensors and optimizer.json, and
    every JSON file there parses and every safetensors file's header is whole and covers the file
    exactly. A pickled state/ (DeepSpeed's) is checked by its trainer_state.json only."""
    path = folder / TRAINER_STATE
    try:
        if not isinstance(json.loads(path.read_text()).get("step"), int):
            return f"{path} cannot be read (no integer step)"
        state = folder / STATE
        if not (state / SAFE_STATE).is_file():
            return None
        missing = [name for name in ("model.safetensors", "optimizer.safetensors") if not (state / name).is_file()]
        if missing:
            return f"{state / missing[0]} cannot be read (missing)"
        for path in sorted(state.iterdir()):
            if path.suffix == ".json":
                json.loads(path.read_text())
            elif path.suffix == ".safetensors":
                with safe_open(str(path), framework="pt"):
                    pass
    except (OSError, ValueError, AttributeError, SafetensorError) as e:  # ValueError: JSON's and UTF-8's errors
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"{path} cannot be read ({why})"
    return None


def drop_frozen(models, weights, output_dir) -> None:
    """accelerate save-state pre-hook (DeepSpeed checkpoints): keep only the trainable tensors of
    each model's state dict (frozen backbones of up to billions of parameters are re-read from
    --backbone)."""
    for model, state in zip(models, weights):
        for name in _frozen(model) & set(state):
            del state[name]


def _frozen(model) -> set[str]:
    return {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def save_checkpoint(accelerator, model, optimizer, cfg, step: int, counters: dict,
                    write_head: Callable[..., None]) -> Path:
    """checkpoint-`step`/ in the layout above; every process calls it. `write_head(folder,
    state_dict=...)` writes head/ on the main process from the full model state dict (gathered
    from ZeRO-3 shards), as a method's `save_head` does; `counters`: the recipe's, for
    trainer_state.json (micro_step among them). A checkpoint-`step`/ already there (of a run
    resumed from an earlier step) is replaced. Refuses (SystemExit on every process, nothing
    written) trainable weights that are not finite."""
    out = Path(cfg.output_dir)
    ckpt = out / f"checkpoint-{step}"
    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(model)
    frozen = _frozen(accelerator.unwrap_model(model))
    trainable = {k: v for k, v in (state_dict or {}).items() if k not in frozen}
    try:
        check_finite(trainable, f"checkpoint-{step}")
        bad = 0.0
    except ValueError as e:
        bad, reason = 1.0, str(e)
    if accelerator.reduce(torch.tensor([bad], device=accelerator.device), reduction="sum").item() > 0:
        raise SystemExit(f"error: not saving {ckpt}: " + (reason if bad else "another process has non-finite weights"))
    if accelerator.is_main_process and ckpt.exists():
        shutil.rmtree(ckpt)
    accelerator.wait_for_everyone()
    if accelerator.state.deepspeed_plugin is not None:
        accelerator.save_state(str(ckpt / STATE), exclude_frozen_parameters=True)
    else:
        save_state(accelerator, trainable, optimizer, ckpt / STATE)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        write_head(ckpt / HEAD, state_dict=state_dict)
        shutil.copyfile(out / "config.yaml", ckpt / "config.yaml")
        write_atomic(ckpt / TRAINER_STATE, json.dumps({"step": step, **counters}))
        prune_checkpoints(out, cfg.keep_checkpoints, current=ckpt)
    accelerator.wait_for_everyone()
    return ckpt


def save_state(accelerator, trainable: dict, optimizer, folder: Path) -> None:
    """state/ as tensors and JSON: the trainable tensors and the optimizer (main process), the
    random generators (every process), the fp16 loss scaler."""
    folder.mkdir(parents=True, exist_ok=True)
    rank = accelerator.process_index
    if accelerator.is_main_process:
        save_file({k: v.detach().cpu().contiguous().clone() for k, v in trainable.items()},
                  str(folder / "model.safetensors"))  # clone: tied tensors would share storage
        sd = optimizer.state_dict()
        tensors, scalars = {}, {}
        for i, entry in sd["state"].items():
            scalars[str(i)] = {k: v for k, v in entry.items() if not torch.is_tensor(v)}
            tensors.update({f"{i}.{k}": v.detach().cpu().contiguous() for k, v in entry.items() if torch.is_tensor(v)})
        save_file(tensors, str(folder / "optimizer.safetensors"))
        if accelerator.scaler is not None:
            write_atomic(folder / "scaler.json", json.dumps(accelerator.scaler.state_dict()))
        write_atomic(folder / SAFE_STATE, json.dumps({"state": scalars, "param_groups": sd["param_groups"]}))
    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    rng = {"python": [version, list(mt), gauss], "numpy": [name, keys.tolist(), pos, has_gauss, cached]}
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors.update({f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    save_file(tensors, str(folder / f"rng_{rank}.safetensors"))
    write_atomic(folder / f"rng_{rank}.json", json.dumps(rng))


def load_state(accelerator, model, optimizer, folder: Path) -> None:
    """Load a state/ written by `save_state` into the prepared model and optimizer (every process).
    Refuses (SystemExit, one line) tensors that do not fit the model (e.g. another --k)."""
    unwrapped = accelerator.unwrap_model(model)
    tensors = load_file(str(folder / "model.safetensors"))
    trainable = {n for n, p in unwrapped.named_parameters(remove_duplicate=False) if p.requires_grad}
    missing = sorted(trainable - set(tensors))
    try:
        if missing:
            raise ValueError(f"missing {missing[:3]}")
        result = unwrapped.load_state_dict(tensors, strict=False)
        if result.unexpected_keys:
            raise ValueError(f"unexpected {result.unexpected_keys[:3]}")
        meta = json.loads((folder / SAFE_STATE).read_text())
        state = {int(i): dict(v) for i, v in meta["state"].items()}
        for key, t in load_file(str(folder / "optimizer.safetensors")).items():
            i, name = key.split(".", 1)
            state.setdefault(int(i), {})[name] = t
        optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    except (ValueError, RuntimeError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SystemExit(f"--resume {folder.parent}: its state does not fit this run's model and optimizer ({first}); "
                         f"resume with that run's settings ({folder.parent / 'config.yaml'})") from None
    if accelerator.scaler is not None and (folder / "scaler.json").is_file():
        accelerator.scaler.load_state_dict(json.loads((folder / "scaler.json").read_text()))
    rank = accelerator.process_index
    if not (folder / f"rng_{rank}.json").is_file():
        tqdm.write(f"[resume] {folder} has no random state of process {rank} (another number of processes): "
                   "the run continues, not exactly as an uninterrupted one")
        return
    rng = json.loads((folder / f"rng_{rank}.json").read_text())
    version, mt, gauss = rng["python"]
    random.setstate((version, tuple(mt), gauss))
    name, keys, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    generators = load_file(str(folder / f"rng_{rank}.safetensors"))
    torch.set_rng_state(generators["torch"])
    cuda = [generators[k] for k in sorted((k for k in generators if k.startswith("cuda.")), key=lambda k: int(k[5:]))]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


def load_checkpoint(accelerator, model, optimizer, cfg) -> dict:
    """Load the --resume checkpoint into the prepared model and optimizer; returns its
    trainer_state ({} without --resume, or with `--resume auto` and no checkpoint yet, whose
    metric lines are then all moved aside). A pickled state/ (see resume_folder: only with
    --trust-checkpoint) goes through accelerate's load_state, non-strictly (it holds only the
    trainable tensors); the LR scheduler that the earlier gated-LoRA layout pickled
    (custom_checkpoint_0.pkl) is rebuilt from the step, not read."""
    deepspeed = accelerator.state.deepspeed_plugin is not None
    folder = resume_folder(cfg, deepspeed=deepspeed)
    say = tqdm.write if accelerator.is_main_process else (lambda msg: None)
    metrics = Path(cfg.output_dir) / "metrics.jsonl"
    if folder is None:
        if cfg.resume and accelerator.is_main_process:
            supersede_metrics(metrics, 0, say)
        return {}
    state_dir = folder / STATE
    if (state_dir / SAFE_STATE).is_file():
        load_state(accelerator, model, optimizer, state_dir)
    else:
        say(f"[resume] {folder}: loading pickled state ({'DeepSpeed' if deepspeed else 'accelerate'}), "
            "trusted by --trust-checkpoint 1")
        strict = {"load_module_strict": False} if deepspeed else {"strict": False}
        with tempfile.TemporaryDirectory() as tmp:
            if (state_dir / "custom_checkpoint_0.pkl").is_file():
                for entry in state_dir.iterdir():
                    if entry.name != "custom_checkpoint_0.pkl":
                        os.symlink(entry.resolve(), Path(tmp) / entry.name)
                state_dir = Path(tmp)
            accelerator.load_state(str(state_dir), **strict)
    state = json.loads((folder / TRAINER_STATE).read_text())
    accelerator.step = state.get("micro_step", 0)  # accelerate's micro-step count (gradient accumulation)
    say(f"[resume] {folder} at step {state['step']}")
    if accelerator.is_main_process:
        supersede_metrics(metrics, state["step"], say)
    return state


def prune_checkpoints(output_dir: Path, keep: int, current: Path | None = None) -> None:
    """Delete all but the `keep` (at least 1) newest checkpoints; `current`, the one just
    written, is never deleted (after a resume from an earlier step, newer-numbered ones of the
    interrupted run may exist: they go first)."""
    others = [c for c in checkpoints(output_dir) if current is None or c.resolve() != Path(current).resolve()]
    now = _step(Path(current)) if current is not None else None
    order = ([c for c in others if now is not None and _step(c) > now]
             + [c for c in others if now is None or _step(c) <= now])
    extra = len(others) + (current is not None) - max(keep, 1)
    for old in order[: max(extra, 0)]:
        shutil.rmtree(old)


def supersede_metrics(metrics_file: Path, step: int, log=print) -> int:
    """On resume from `step`: move the metric lines logged after it (the interrupted run's, which
    the resumed run logs again) from metrics_file to metrics.superseded.jsonl beside it, so the
    curves hold each step once and nothing is lost. Says so through `log`; returns how many
    lines moved."""
    metrics_file = Path(metrics_file)
    if not metrics_file.is_file():
        return 0
    keep, moved = [], []
    for line in read_jsonl(metrics_file):  # lines end at \n only: a raw U+2028 in a value is text
        later = isinstance(line.value, dict) and line.value.get("step", 0) > step  # else not ours to judge: kept
        (moved if later else keep).append(line.raw if line.raw.endswith(b"\n") else line.raw + b"\n")
    if moved:
        with open(metrics_file.with_name("metrics.superseded.jsonl"), "ab") as f:
            f.write(b"".join(moved))
        write_atomic(metrics_file, b"".join(keep))
        log(f"[resume] {len(moved)} metric line(s) logged after step {step} moved to metrics.superseded.jsonl")
    return len(moved)
