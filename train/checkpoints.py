"""What every training script shares: its checkpoint-N/ folders and the resumable data order."""

from __future__ import annotations

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
