"""What every training script shares: its checkpoint-N/ folders and the resumable data order."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch


def checkpoints(output_dir: Path) -> list[Path]:
    """checkpoint-N/ folders with a trainer_state.json (i.e. complete), oldest first."""
    found = Path(output_dir).glob("checkpoint-*/trainer_state.json")
    return [p.parent for p in sorted(found, key=lambda p: int(p.parent.name.split("-")[1]))]


def latest_checkpoint(output_dir: Path) -> Path | None:
    done = checkpoints(output_dir)
    return done[-1] if done else None


def resume_folder(resume: str, output_dir: Path) -> Path | None:
    """`--resume`: '' = none, `auto` = the newest checkpoint in output_dir, else the folder given."""
    if resume == "auto":
        return latest_checkpoint(output_dir)
    return Path(resume) if resume else None


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


def micro_batch(features, step: int, rank: int, world: int, batch_size: int, seed: int) -> list:
    """The sequences of global micro-step `step` on process `rank`: a fixed, seeded reshuffle per
    epoch, so a resumed run sees exactly the batches it would have seen."""
    out = []
    for j in range(batch_size):
        p = (step * world + rank) * batch_size + j
        epoch, i = divmod(p, len(features))
        order = torch.randperm(len(features), generator=torch.Generator().manual_seed(seed + epoch))
        out.append(features[int(order[i])])
    return out
