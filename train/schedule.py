"""The learning-rate schedule of every recipe: a multiplier of the peak --lr per optimizer step.

Warm-up, stable, decay: linear warm-up over --warmup-steps, constant, then over the last
--decay-steps of --max-steps a fall to --min-lr-ratio, linear or along a half cosine
(--lr-decay). The schedule is a function of the step (and, for byte_lm, of the share of its time
budget used), so nothing of it is checkpointed: a resumed run rebuilds it from the step, and one
resumed with a new --decay-steps or --max-steps follows the new schedule from where it stopped.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

DECAYS = ("linear", "cosine")


def lr_multiplier(step: int, max_steps: int, warmup_steps: int = 0, decay_steps: int = 0, min_lr_ratio: float = 0.0,
                  decay: str = "linear", progress: float = 0.0) -> float:
    """Multiplier of the peak learning rate at optimizer step `step` (0-based).

    `decay_steps` -1 = every step after the warm-up. `progress`: the share of the run done by
    another measure (byte_lm: its time budget); the decay follows whichever of it and the step
    count is further along, so a run cut short by time still ends at `min_lr_ratio`."""
    factor = min(1.0, (step + 1) / warmup_steps) if warmup_steps else 1.0
    if decay_steps < 0:
        decay_steps = max_steps - warmup_steps
    if decay_steps <= 0:
        return factor
    start = max_steps - decay_steps
    done = min(1.0, max(0.0, (max(step + 1, progress * max_steps) - start) / decay_steps))
    if decay == "cosine":
        done = 0.5 * (1.0 - math.cos(math.pi * done))
    return factor * (1.0 - (1.0 - min_lr_ratio) * done)


def lr_scheduler(optimizer: torch.optim.Optimizer, cfg, start_step: int = 0,
                 progress: Callable[[], float] | None = None) -> torch.optim.lr_scheduler.LambdaLR:
    """The schedule of `cfg` (a `TrainArgs`) from optimizer step `start_step` on, peaking at cfg.lr
    in every parameter group (also after a resume, whose optimizer state carries the old peak)."""
    for group in optimizer.param_groups:
        group["initial_lr"] = cfg.lr
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_multiplier(
        start_step + s, cfg.max_steps, cfg.warmup_steps, cfg.decay_steps, cfg.min_lr_ratio, cfg.lr_decay,
        progress() if progress else 0.0))
