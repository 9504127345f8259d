"""The one checkpoint layout of every recipe, and resuming from it.

    OUTPUT_DIR/checkpoint-N/
        trainer_state.json   step, micro_step and the recipe's counters (written last: a folder
                             without it is incomplete and never resumed)
        config.yaml          the resolved config and the command that ran it
        head/                what the run trained, loadable on its own (a method's head folder,
                             or byte_lm's Hugging Face model folder)
        state/               accelerator.save_state: the trainable tensors, optimizer, RNG of
                             every process (DeepSpeed: its own shards)

The learning-rate schedule is not saved: it is rebuilt from trainer_state's step. A resume loads
state/ into the prepared model and optimizer and moves the metric lines logged after the
checkpoint's step aside, so an interrupted and resumed run logs the same losses as one that ran
straight through.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from tqdm import tqdm

TRAINER_STATE = "trainer_state.json"
STATE = "state"
HEAD = "head"


def checkpoints(output_dir: Path) -> list[Path]:
    """checkpoint-N/ folders with a trainer_state.json (i.e. complete), oldest first."""
    found = Path(output_dir).glob(f"checkpoint-*/{TRAINER_STATE}")
    return [p.parent for p in sorted(found, key=lambda p: int(p.parent.name.split("-")[1]))]


def latest_checkpoint(output_dir: Path) -> Path | None:
    done = checkpoints(output_dir)
    return done[-1] if done else None


def resume_folder(cfg, old_layout: str = "") -> Path | None:
    """`--resume`: '' = none, `auto` = the newest checkpoint in output_dir, else the folder given.
    Refuses (SystemExit, one line) a folder that is not a checkpoint of this layout, saying what to
    do with one of an earlier layout (`old_layout`; `{folder}` in it is the folder), before any model
    is loaded."""
    if not cfg.resume:
        return None
    folder = latest_checkpoint(Path(cfg.output_dir)) if cfg.resume == "auto" else Path(cfg.resume)
    if folder is None:
        return None
    if not (folder / TRAINER_STATE).is_file():
        raise SystemExit(f"--resume {folder}: not a checkpoint (no {TRAINER_STATE})")
    if not (folder / STATE).is_dir():
        files = ", ".join(sorted(p.name for p in folder.iterdir() if p.is_file()))
        raise SystemExit(f"--resume {folder}: a checkpoint of an earlier layout ({files}; no {STATE}/ folder) "
                         f"that this version cannot resume; {old_layout.format(folder=folder)}")
    return folder


def drop_frozen(models, weights, output_dir) -> None:
    """accelerate save-state pre-hook: keep only the trainable tensors of each model's state dict
    (frozen backbones of up to billions of parameters are re-read from --backbone)."""
    for model, state in zip(models, weights):
        frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
        for name in frozen & set(state):
            del state[name]


def save_checkpoint(accelerator, model, cfg, step: int, counters: dict,
                    write_head: Callable[..., None]) -> Path:
    """checkpoint-`step`/ in the layout above; every process calls it. `write_head(folder,
    state_dict=...)` writes head/ on the main process from the full model state dict (gathered
    from ZeRO-3 shards), as a method's `save_head` does; `counters`: the recipe's, for
    trainer_state.json (micro_step among them)."""
    out = Path(cfg.output_dir)
    ckpt = out / f"checkpoint-{step}"
    accelerator.wait_for_everyone()
    deepspeed = accelerator.state.deepspeed_plugin is not None
    accelerator.save_state(str(ckpt / STATE), **({"exclude_frozen_parameters": True} if deepspeed else {}))
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        write_head(ckpt / HEAD, state_dict=state_dict)
        shutil.copyfile(out / "config.yaml", ckpt / "config.yaml")
        (ckpt / TRAINER_STATE).write_text(json.dumps({"step": step, **counters}))
        prune_checkpoints(out, cfg.keep_checkpoints)
    accelerator.wait_for_everyone()
    return ckpt


def load_checkpoint(accelerator, cfg) -> dict:
    """Load the --resume checkpoint into the prepared model and optimizer; returns its
    trainer_state ({} without --resume). The state may hold only the trainable tensors, so the
    model loads non-strictly. A gated-LoRA checkpoint of the earlier layout also pickled its LR
    scheduler (custom_checkpoint_0.pkl), now rebuilt from the step: the rest loads without it."""
    folder = resume_folder(cfg)
    if folder is None:
        return {}
    state_dir = folder / STATE
    deepspeed = accelerator.state.deepspeed_plugin is not None
    strict = {"load_module_strict": False} if deepspeed else {"strict": False}
    with tempfile.TemporaryDirectory() as tmp:
        if (state_dir / "custom_checkpoint_0.pkl").is_file():
            for entry in state_dir.iterdir():
                if entry.name != "custom_checkpoint_0.pkl":
                    os.symlink(entry.resolve(), Path(tmp) / entry.name)
            state_dir = Path(tmp)
        accelerator.load_state(str(state_dir), **strict)
    state = json.loads((folder / TRAINER_STATE).read_text())
    say = tqdm.write if accelerator.is_main_process else (lambda msg: None)
    say(f"[resume] {folder} at step {state['step']}")
    if accelerator.is_main_process:
        supersede_metrics(Path(cfg.output_dir) / "metrics.jsonl", state["step"], say)
    return state


def prune_checkpoints(output_dir: Path, keep: int) -> None:
    """Delete all but the `keep` newest checkpoints."""
    done = checkpoints(output_dir)
    for old in done[: max(len(done) - keep, 0)]:
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
    for line in metrics_file.read_text().splitlines():
        try:
            later = json.loads(line).get("step", 0) > step
        except (json.JSONDecodeError, AttributeError):
            later = False  # not ours to judge: kept where it was
        (moved if later else keep).append(line)
    if moved:
        with open(metrics_file.with_name("metrics.superseded.jsonl"), "a") as f:
            f.write("\n".join(moved) + "\n")
        tmp = metrics_file.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        tmp.replace(metrics_file)
        log(f"[resume] {len(moved)} metric line(s) logged after step {step} moved to metrics.superseded.jsonl")
    return len(moved)
