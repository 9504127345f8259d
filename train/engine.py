"""What every training recipe shares, as plain functions and small classes that the recipes call
(their loops stay in the recipes): the shared config fields, the one distributed stack (an
accelerate `Accelerator`, under `accelerate launch`, `torchrun` or plain `python`; DDP or
DeepSpeed), the resumable seeded data order, the metrics writer and the log-interval window.
Checkpoints are `mtpkit.train.checkpoints`, the learning-rate schedule `mtpkit.train.schedule`.

A recipe reads: cfg = parse_config(...); accelerator = setup(cfg, ...); build the model and the
optimizer; model, optimizer, scheduler, state = prepare(...); then its own loop (batch, forward
and loss under `accelerator.accumulate`, then `backward_step`: backward, clip, step, schedule; log through
`Window` and `MetricsWriter`; evaluate; `checkpoints.save_checkpoint`), and `finish`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from mtpkit.train import checkpoints
from mtpkit.train.config import ConfigError, add_config_args, resolve, to_yaml
from mtpkit.train.schedule import DECAYS, lr_scheduler

MIXED_PRECISION = ("no", "bf16", "fp16")


@dataclasses.dataclass
class TrainArgs:
    """The fields every recipe has; a recipe's config extends it (and may change defaults)."""
    output_dir: str = "runs/train"
    """where config, metrics, checkpoints and tensorboard logs go"""
    max_steps: int = 1000
    """optimizer steps"""
    batch_size: int = 1
    """sequences per process per micro-step"""
    grad_accum: int = 1
    """micro-steps per optimizer step"""
    lr: float = 2e-4
    """peak AdamW learning rate"""
    warmup_steps: int = 0
    """linear warm-up steps"""
    decay_steps: int = 0
    """steps at the end of --max-steps over which the lr falls to --min-lr-ratio (0 = none, flat
    after the warm-up; -1 = every step after the warm-up)"""
    lr_decay: str = "linear"
    """shape of that fall: linear | cosine"""
    min_lr_ratio: float = 0.1
    """final learning rate as a fraction of --lr when the lr decays"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping (0 = off)"""
    mixed_precision: str = "no"
    """no | bf16 | fp16 (autocast of the forward; weights stay in their dtype)"""
    seed: int = 0
    """seed of the init and the data order"""
    log_every: int = 1
    """steps between metric lines"""
    eval_every: int = 100
    """steps between evaluations (0 = none during training)"""
    save_every: int = 100
    """steps between checkpoints (the last step always saves)"""
    keep_checkpoints: int = 2
    """newest checkpoints kept on disk"""
    resume: str = ""
    """checkpoint folder to resume from, or `auto` for the newest in output_dir"""
    tensorboard: bool = False
    """also log to tensorboard (output_dir/tensorboard)"""
    dist_timeout: int = 1800
    """seconds a process waits on the others in a collective before failing (several processes)"""


def argument_parser(cls, description: str, configs: str) -> argparse.ArgumentParser:
    """`--config YAML` and a flag per field of the config dataclass `cls` (its docstrings as help)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help=f"YAML config ({configs}); flags override it")
    add_config_args(p, cls)
    return p


def parse_config(parser: argparse.ArgumentParser, cls, argv=None):
    """Defaults < YAML < flags, and the checks of the shared fields (an error names the flag)."""
    try:
        cfg = resolve(cls, parser.parse_args(argv))
    except ConfigError as e:
        parser.error(str(e))
    if min(cfg.max_steps, cfg.batch_size, cfg.grad_accum, cfg.keep_checkpoints) < 1:
        parser.error("--max-steps, --batch-size, --grad-accum and --keep-checkpoints must be >= 1")
    if cfg.mixed_precision not in MIXED_PRECISION:
        parser.error(f"--mixed-precision must be one of {MIXED_PRECISION}, got {cfg.mixed_precision!r}")
    if cfg.lr_decay not in DECAYS:
        parser.error(f"--lr-decay must be one of {DECAYS}, got {cfg.lr_decay!r}")
    if not -1 <= cfg.decay_steps <= cfg.max_steps:
        parser.error(f"--decay-steps must be -1 or in [0, --max-steps={cfg.max_steps}], got {cfg.decay_steps}")
    if not 0.0 <= cfg.min_lr_ratio <= 1.0:
        parser.error(f"--min-lr-ratio must be in [0, 1], got {cfg.min_lr_ratio}")
    return cfg


def setup(cfg: TrainArgs, old_layout: str):
    """The run's `Accelerator` (seeded; output_dir/config.yaml written by the main process). A
    --resume folder that cannot be resumed is refused here, before any model is loaded;
    `old_layout` says what to do with a checkpoint of an earlier layout (`{folder}`: the folder).

    Several processes without a GPU (torchrun, `accelerate launch` with a multi-process config):
    accelerate would leave them unconnected (each believing it is alone), so plain DDP is told to
    use CPUs and gloo, and DeepSpeed gets gloo as its process-group backend."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs, set_seed

    world = int(os.environ.get("WORLD_SIZE", "1"))
    cpu_processes = world > 1 and not torch.cuda.is_available()
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    group = InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=cfg.dist_timeout),
                                   **({"backend": "gloo"} if cpu_processes else {}))
    out = Path(cfg.output_dir)
    accelerator = Accelerator(gradient_accumulation_steps=cfg.grad_accum, mixed_precision=cfg.mixed_precision,
                              log_with="tensorboard" if cfg.tensorboard else None, project_dir=str(out),
                              cpu=cpu_processes and not deepspeed, kwargs_handlers=[group])
    set_seed(cfg.seed)
    checkpoints.resume_folder(cfg, old_layout)
    if accelerator.is_main_process:
        launcher = ("accelerate launch" if "ACCELERATE_MIXED_PRECISION" in os.environ
                    else "torchrun" if world > 1 else "python")
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(to_yaml(cfg, " ".join([launcher] + sys.argv)))
    if cfg.tensorboard:
        accelerator.init_trackers("tensorboard", config=_flat(dataclasses.asdict(cfg)))
    return accelerator


def printer(accelerator):
    """print() of the main process (through tqdm, so progress bars stay intact); others say nothing."""
    return (lambda msg: tqdm.write(msg)) if accelerator.is_main_process else (lambda msg: None)


def prepare(accelerator, cfg: TrainArgs, model: torch.nn.Module, optimizer,
            progress: Callable[[], float] | None = None):
    """accelerator.prepare(model, optimizer) (DeepSpeed told the batch sizes; checkpoints keep only
    the trainable tensors), the --resume checkpoint loaded into them, and the LR schedule from its
    step (`progress`: see schedule.lr_multiplier). Returns (model, optimizer, scheduler, trainer
    state: "step", "micro_step" and the recipe's counters of the checkpoint; zeros for a new run).
    The scheduler is stepped by the recipe once per optimizer step (a prepared one would step once
    per process)."""
    if accelerator.state.deepspeed_plugin is not None:
        ds = accelerator.state.deepspeed_plugin.deepspeed_config
        ds["train_micro_batch_size_per_gpu"] = cfg.batch_size
        ds["gradient_accumulation_steps"] = cfg.grad_accum
        ds["train_batch_size"] = cfg.batch_size * cfg.grad_accum * accelerator.num_processes
        printer(accelerator)(f"[deepspeed] ZeRO stage {ds.get('zero_optimization', {}).get('stage')} on "
                             f"{accelerator.num_processes} process(es)")
    accelerator.register_save_state_pre_hook(checkpoints.drop_frozen)
    model, optimizer = accelerator.prepare(model, optimizer)
    state = {"step": 0, "micro_step": 0, **checkpoints.load_checkpoint(accelerator, cfg)}
    return model, optimizer, lr_scheduler(optimizer, cfg, state["step"], progress), state


def backward_step(accelerator, loss: torch.Tensor, params, optimizer, scheduler, max_grad_norm: float) -> None:
    """One micro-step's update, inside the recipe's `with accelerator.accumulate(model):` block:
    backward; on the micro-step that completes an optimizer step (accelerate syncs the
    gradients), clip `params` to `max_grad_norm` (0 = off) and step the scheduler. The optimizer
    prepared by accelerate skips its own step and zero_grad until then."""
    accelerator.backward(loss)
    if accelerator.sync_gradients and max_grad_norm > 0:
        accelerator.clip_grad_norm_(params, max_grad_norm)
    optimizer.step()
    if accelerator.sync_gradients:
        scheduler.step()
    optimizer.zero_grad()


def finish(accelerator) -> None:
    """End the run on every process: trackers closed, then the process group destroyed. The
    accelerator lets go of the prepared model first, so a DDP reducer (which holds the process
    group) is freed while every process is still here, not at exit, where on gloo a process could
    wait forever on its peer's closed sockets; a recipe drops its own reference before calling this."""
    accelerator.free_memory()
    gc.collect()
    accelerator.wait_for_everyone()
    accelerator.end_training()


def micro_batch(features: list, step: int, accelerator, cfg: TrainArgs) -> list:
    """The examples of global micro-step `step` on this process: a fixed, seeded reshuffle per
    epoch, so a resumed run sees exactly the batches it would have seen."""
    rank, world, out = accelerator.process_index, accelerator.num_processes, []
    for j in range(cfg.batch_size):
        p = (step * world + rank) * cfg.batch_size + j
        epoch, i = divmod(p, len(features))
        order = torch.randperm(len(features), generator=torch.Generator().manual_seed(cfg.seed + epoch))
        out.append(features[int(order[i])])
    return out


class MetricsWriter:
    """output_dir/metrics.jsonl, one JSON object a line with its "step", written by the main
    process only; with --tensorboard its numbers go to tensorboard too."""

    def __init__(self, accelerator, cfg: TrainArgs):
        self.accelerator, self.tensorboard = accelerator, cfg.tensorboard
        self.path = Path(cfg.output_dir) / "metrics.jsonl"

    def write(self, row: dict) -> None:
        if not self.accelerator.is_main_process:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.tensorboard:
            numbers = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}
            self.accelerator.log(numbers, step=row["step"])


class Window:
    """What the micro-steps of one log interval add up to, over every process.

    `add(loss=..., nll_per_offset=...)`: values (scalars or vectors) whose mean is logged (a NaN
    is left out of its mean); `count(bytes=...)`: counters whose total is logged; `exclude(s)`:
    seconds that are not training (evaluation); `reduce()` -> (means, totals, seconds) over all
    processes, and starts the next window. Every process must add the same names in the same order.
    """

    def __init__(self, accelerator):
        self.accelerator = accelerator
        self._start()

    def _start(self) -> None:
        self.t0, self.sums, self.n, self.totals = time.perf_counter(), {}, {}, {}

    def add(self, **values) -> None:
        for name, value in values.items():
            v = torch.as_tensor(value).detach().to("cpu", torch.float64).flatten()
            ok = ~torch.isnan(v)
            self.sums[name] = self.sums.get(name, 0.0) + torch.where(ok, v, 0.0)
            self.n[name] = self.n.get(name, 0.0) + ok.double()

    def count(self, **values) -> None:
        for name, value in values.items():
            self.totals[name] = self.totals.get(name, 0.0) + float(value)

    def exclude(self, seconds: float) -> None:
        self.t0 += seconds

    def reduce(self) -> tuple[dict, dict, float]:
        seconds = time.perf_counter() - self.t0
        parts = [*self.sums.values(), *self.n.values(), torch.tensor(list(self.totals.values()), dtype=torch.float64)]
        flat = self.accelerator.reduce(torch.cat(parts).to(self.accelerator.device), reduction="sum").cpu()
        sizes = [len(v) for v in self.sums.values()]
        sums, n = flat[:sum(sizes)].split(sizes), flat[sum(sizes):2 * sum(sizes)].split(sizes)
        means = {}
        for name, s, c in zip(self.sums, sums, n):
            mean = (s / c).tolist()
            means[name] = mean[0] if len(mean) == 1 else mean
        totals = dict(zip(self.totals, flat[2 * sum(sizes):].tolist()))
        self._start()
        return means, totals, seconds


def _flat(d: dict, prefix="") -> dict:
    """A nested config as flat scalars (tensorboard's hparams)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return out
