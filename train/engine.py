"""What every training recipe shares, as plain functions and small classes that the recipes call
(their loops stay in the recipes): the one distributed stack (an
accelerate `Accelerator`, under `accelerate launch`, `torchrun` or plain `python`; DDP or
DeepSpeed), the resumable seeded data order, the metrics writer and the log-interval window.
Checkpoints are `mtpkit.train.checkpoints`, the learning-rate schedule `mtpkit.train.schedule`.

A recipe reads: cfg = recipe_config.parse_config(...) (the shared config fields and flags:
`mtpkit.train.recipe_config`); accelerator = setup(cfg, ...); build the
model and the optimizer; model, optimizer, scheduler, state = prepare(...); then its own loop
(batch, forward and loss under `accelerator.accumulate`, then a `BackwardStep`: backward, clip,
step, schedule, and the non-finite rule; log through `Window` and `MetricsWriter`; evaluate (on the main process, or on
every process under ZeRO-3: `evaluates_here`); `checkpoints.save_checkpoint`), and `finish`.

An output dir holds one run: while a run lives, its main process holds an exclusive lock on
output_dir/.mtpkit.lock (`mtpkit.train.output_dir`), so a second run into the same folder is refused at
once, whatever its flags; a fresh run into a folder with another (ended) run's files is refused
unless `--resume` (continue it) or `--overwrite 1` (delete that run's files first);
output_dir/config.yaml is written only once the run has started (after the --resume checkpoint
loaded).
"""

from __future__ import annotations

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

from mtpkit.models.backbone import resolve_device, resolve_dtype
from mtpkit.models.atomic_write import write_atomic
from mtpkit.train import checkpoints
from mtpkit.train.output_dir import claim_output_dir, die_with_parent, lock_output_dir, unlock_output_dir
from mtpkit.train.config import to_yaml
from mtpkit.train.recipe_config import TrainArgs
from mtpkit.train.schedule import lr_scheduler


def setup(cfg: TrainArgs, old_layout: str):
    """The run's `Accelerator` (seeded). Refused here, before any model is loaded and before
    anything is written: a --resume folder that cannot be resumed (`old_layout` says what to do
    with a checkpoint of an earlier layout; `{folder}`: the folder; `--resume auto` says here which
    unreadable checkpoints it steps past), an output_dir that another living run holds (see
    `lock_output_dir`; this run then holds it) and one that holds another run's files (see
    `claim_output_dir`). A process started by a launcher (torchrun, accelerate launch) ends
    when the launcher dies (`die_with_parent`).

    --device (`train_device`): cpu or no GPU -> Accelerator(cpu=True); auto/cuda -> accelerate's
    choice, each process its own GPU; cuda:N -> that GPU, for a single process. Several processes
    on CPUs (torchrun, `accelerate launch` with a multi-process config): accelerate would leave
    them unconnected (each believing it is alone), so plain DDP is told to use CPUs and gloo, and
    DeepSpeed gets gloo as its process-group backend."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs, set_seed

    world = int(os.environ.get("WORLD_SIZE", "1"))
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    device = train_device(cfg.device, world, deepspeed)
    cpu_processes = world > 1 and device.type == "cpu"
    if cfg.nonfinite == "skip" and deepspeed:
        raise SystemExit("error: --nonfinite skip: DeepSpeed steps inside its backward, so a step cannot be skipped; "
                         "use --nonfinite stop")
    if device.type == "cuda" and device.index is not None and world == 1:
        torch.cuda.set_device(device)  # accelerate's one process uses the current GPU
    mixed_precision = autocast_precision(cfg.mixed_precision, resolve_dtype(cfg.dtype, device))
    launched = "LOCAL_RANK" in os.environ or "ACCELERATE_MIXED_PRECISION" in os.environ
    if launched:
        die_with_parent()
    if deepspeed and device.type == "cpu":
        skip_shared_memory_collectives()
    group = InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=cfg.dist_timeout),
                                   **({"backend": "gloo"} if cpu_processes else {}))
    out = Path(cfg.output_dir)
    accelerator = Accelerator(gradient_accumulation_steps=cfg.grad_accum, mixed_precision=mixed_precision,
                              log_with="tensorboard" if cfg.tensorboard else None, project_dir=str(out),
                              cpu=device.type == "cpu" and not deepspeed, kwargs_handlers=[group])
    set_seed(cfg.seed)
    checkpoints.resume_folder(cfg, old_layout, deepspeed=deepspeed, log=printer(accelerator))
    lock_output_dir(accelerator, cfg)
    claim_output_dir(accelerator, cfg)
    if cfg.tensorboard:
        accelerator.init_trackers("tensorboard", config=_flat(dataclasses.asdict(cfg)))
    return accelerator


def train_device(flag: str, world: int, deepspeed: bool) -> torch.device:
    """The device --device names for this process (models/backbone.py resolve_device), or
    SystemExit: a GPU that is not there; cuda:N under several processes (each takes its own,
    cuda:LOCAL_RANK); cpu under DeepSpeed on a machine with GPUs (DeepSpeed picks the GPU itself)."""
    if flag.startswith("cuda:") and world > 1:
        raise SystemExit(f"error: --device {flag} names one GPU, but {world} processes run (each takes its own "
                         "GPU, cuda:LOCAL_RANK): use --device cuda or auto, and CUDA_VISIBLE_DEVICES to choose GPUs")
    if flag == "cpu" and deepspeed and torch.cuda.is_available():
        raise SystemExit("error: --device cpu under DeepSpeed on a machine with GPUs: DeepSpeed runs on the GPU "
                         "whatever accelerate is told; hide the GPUs (CUDA_VISIBLE_DEVICES=) to train on CPUs")
    try:
        return resolve_device(flag)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


def skip_shared_memory_collectives() -> None:
    """DeepSpeed on CPUs: its process group (started by the `Accelerator`) would first compile its
    shared-memory collectives, a C++ op, 30-50 s on 2 cores once per Python environment. Only
    its tensor-parallel inference all-reduce uses them; ZeRO's collectives are torch.distributed's
    (gloo here). Marked unavailable, nothing is compiled and training is the same. (On GPUs the op
    does not exist.)"""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def autocast_precision(flag: str, backbone: torch.dtype) -> str:
    """accelerate's mixed_precision for --mixed-precision `flag` over a backbone of dtype
    `backbone` (see TrainArgs.mixed_precision); `no` over a half-precision backbone is a SystemExit
    (float32 trained parameters cannot meet its activations without autocast)."""
    half = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(backbone)
    if flag == "auto":
        return half or "no"
    if flag == "no" and half:
        raise SystemExit(f"error: --mixed-precision no with a {str(backbone).removeprefix('torch.')} backbone: the "
                         f"float32 trained parameters meet its activations only under autocast; use "
                         f"--mixed-precision auto or {half}, or --dtype float32")
    return flag


def backbone_dtype(cfg: TrainArgs, accelerator) -> torch.dtype:
    """The frozen backbone's weight dtype: --dtype on the run's device (auto: see TrainArgs.dtype)."""
    return resolve_dtype(cfg.dtype, accelerator.device)


def float32_trainable(params) -> list:
    """The trained parameters in float32 (a LoRA or head built over a bfloat16 backbone may come out
    bfloat16): the optimizer's updates and states stay exact. Returns them as a list."""
    params = list(params)
    for p in params:
        if p.is_floating_point() and p.dtype != torch.float32:
            p.data = p.data.float()
    return params


def printer(accelerator):
    """print() of the main process (through tqdm, so progress bars stay intact); others say nothing."""
    return (lambda msg: tqdm.write(msg)) if accelerator.is_main_process else (lambda msg: None)


def prepare(accelerator, cfg: TrainArgs, model: torch.nn.Module, optimizer,
            progress: Callable[[], float] | None = None):
    """accelerator.prepare(model, optimizer) (DeepSpeed told the batch sizes; checkpoints keep only
    the trainable tensors), the --resume checkpoint loaded into them, and the LR schedule from its
    step (`progress`: see schedule.lr_multiplier). Then, the run having started, the main process
    writes output_dir/config.yaml. Returns (model, optimizer, scheduler, trainer state: "step",
    "micro_step" and the recipe's counters of the checkpoint; zeros for a new run). The scheduler
    is stepped by the recipe once per optimizer step (a prepared one would step once per process)."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None:
        ds = plugin.deepspeed_config
        ds["train_micro_batch_size_per_gpu"] = cfg.batch_size
        ds["gradient_accumulation_steps"] = cfg.grad_accum
        ds["train_batch_size"] = cfg.batch_size * cfg.grad_accum * accelerator.num_processes
        set_gradient_clipping(ds, cfg.max_grad_norm, printer(accelerator))
        plugin.gradient_clipping = cfg.max_grad_norm
    accelerator.register_save_state_pre_hook(checkpoints.drop_frozen)
    model, optimizer = accelerator.prepare(model, optimizer)
    if plugin is not None:  # what the DeepSpeed engine itself now uses
        printer(accelerator)(f"[deepspeed] ZeRO stage {model.zero_optimization_stage()} on "
                             f"{accelerator.num_processes} process(es); gradient clipping {model.gradient_clipping()}")
    state = {"step": 0, "micro_step": 0, **checkpoints.load_checkpoint(accelerator, model, optimizer, cfg)}
    if accelerator.is_main_process:
        launcher = ("accelerate launch" if "ACCELERATE_MIXED_PRECISION" in os.environ
                    else "torchrun" if accelerator.num_processes > 1 else "python")
        out = Path(cfg.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(out / "config.yaml", to_yaml(cfg, " ".join([launcher] + sys.argv)))
    accelerator.wait_for_everyone()
    return model, optimizer, lr_scheduler(optimizer, cfg, state["step"], progress), state


def evaluates_here(accelerator) -> bool:
    """Whether this process runs the evaluation during training: the main process alone (the
    others wait at a barrier), except under DeepSpeed ZeRO-3 on several processes, where the
    weights are split between the processes and each layer's forward first gathers its weights
    from all of them, so every process must run the same forwards in the same order (the main
    process alone would wait forever)."""
    return accelerator.is_main_process or (zero_stage(accelerator) == 3 and accelerator.num_processes > 1)


def zero_stage(accelerator) -> int | None:
    """The DeepSpeed ZeRO stage of the run (None without DeepSpeed)."""
    plugin = accelerator.state.deepspeed_plugin
    return plugin.deepspeed_config.get("zero_optimization", {}).get("stage") if plugin is not None else None


def set_gradient_clipping(ds: dict, max_grad_norm: float, log) -> None:
    """DeepSpeed clips inside its own step, to its config's `gradient_clipping` (accelerate's
    clip_grad_norm_ only reads the norm back), so --max-grad-norm is written there (0 = off). A
    different number already there (the accelerate config's `gradient_clipping`, a DeepSpeed JSON)
    is replaced, with a note: the flag is the value saved in config.yaml with every checkpoint."""
    before = ds.get("gradient_clipping", "auto")
    if before != "auto" and float(before) != max_grad_norm:
        log(f"[deepspeed] gradient_clipping {before} of the DeepSpeed/accelerate config replaced by "
            f"--max-grad-norm {max_grad_norm}")
    ds["gradient_clipping"] = max_grad_norm


class BackwardStep:
    """One micro-step's update, called with the loss inside the recipe's `with
    accelerator.accumulate(model):` block: backward; on the micro-step that completes an
    optimizer step (accelerate syncs the gradients), clip `params` to cfg.max_grad_norm (0 = off),
    step the optimizer and the scheduler. The optimizer prepared by accelerate skips its own step
    and zero_grad until then.

    A non-finite loss on any micro-step of the optimizer step, on any process, or a non-finite
    gradient norm, is decided on by every process together at that micro-step (before DeepSpeed's
    backward, which steps): --nonfinite stop ends the run (SystemExit on every process, no
    update); skip drops the gradients, steps only the scheduler, and the call returns True (the
    recipe counts it). Under fp16 loss scaling (--mixed-precision fp16) an overflowing gradient
    norm is the scaler's: it skips that step and lowers its scale, and the call returns True."""

    def __init__(self, accelerator, cfg: TrainArgs, params, optimizer, scheduler):
        self.accelerator, self.params, self.optimizer, self.scheduler = accelerator, list(params), optimizer, scheduler
        self.max_grad_norm, self.mode, self.grad_accum = cfg.max_grad_norm, cfg.nonfinite, cfg.grad_accum
        self.bad = torch.zeros((), dtype=torch.bool, device=accelerator.device)  # on device: no sync per micro-step

    def __call__(self, loss: torch.Tensor) -> bool:
        acc = self.accelerator
        self.bad = self.bad | ~torch.isfinite(loss.detach()).all()
        bad = False
        if acc.sync_gradients:
            bad = acc.reduce(self.bad.float().reshape(1), reduction="sum").item() > 0
            self.bad = torch.zeros_like(self.bad)
            if bad:
                self._stop("loss")
        acc.backward(loss)
        if acc.sync_gradients and self.max_grad_norm > 0 and not bad:
            norm = acc.clip_grad_norm_(self.params, self.max_grad_norm)
            bad = norm is not None and not bool(torch.isfinite(torch.as_tensor(norm)).all())  # same on every process
            if bad and acc.scaler is not None:
                bad = False  # fp16 loss scaling: the scaler skips this step itself and lowers its scale
            if bad:
                self._stop(f"gradient norm ({float(norm)})")
        if bad:  # skip: the gradients of this optimizer step are dropped
            self.optimizer.zero_grad()
            self.scheduler.step()
            return True
        self.optimizer.step()
        skipped = acc.sync_gradients and acc.scaler is not None and acc.optimizer_step_was_skipped
        if acc.sync_gradients:
            self.scheduler.step()
        self.optimizer.zero_grad()
        return skipped

    def _stop(self, what: str) -> None:
        if self.mode == "stop":
            step = self.accelerator.step // self.grad_accum
            raise SystemExit(f"error: non-finite {what} at optimizer step {step}: the run stops "
                             "before the update, its last checkpoint intact; lower --lr, check the data, or pass "
                             "--nonfinite skip to skip such steps")


def finish(accelerator) -> None:
    """End the run on every process: trackers closed, the process group destroyed, the output
    dir's lock let go (`lock_output_dir`). The accelerator lets go of the prepared model first, so
    a DDP reducer (which holds the process group) is freed while every process is still here, not
    at exit, where on gloo a process could wait forever on its peer's closed sockets; a recipe
    drops its own reference before calling this."""
    accelerator.free_memory()
    gc.collect()
    accelerator.wait_for_everyone()
    accelerator.end_training()
    unlock_output_dir(accelerator.project_dir)


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


class TrainClock:
    """Seconds spent training, evaluation excluded (`exclude`), carried across a resume: start it
    from the checkpoint's `train_seconds` and save `seconds()` with the next checkpoint. What the
    `train_seconds` of a trainer's `sim_tau` rows counts (a curve of tau against training time)."""

    def __init__(self, seconds: float = 0.0):
        self.t0 = time.perf_counter() - seconds

    def seconds(self) -> float:
        return time.perf_counter() - self.t0

    def exclude(self, seconds: float) -> None:
        self.t0 += seconds


def timed_eval(evaluate, step: int, clock: TrainClock, window, metrics) -> float:
    """`evaluate()` (a trainer's simulated tau) kept off the training clock and the log window's
    throughput; its metrics row (step, sim_tau, the training seconds before it, its own seconds)
    written. Returns the tau."""
    train_seconds = clock.seconds()
    started = time.perf_counter()
    tau = evaluate()
    took = time.perf_counter() - started
    metrics.write({"step": step, "sim_tau": tau, "train_seconds": train_seconds, "eval_seconds": took})
    window.exclude(took)
    clock.exclude(took)
    return tau


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
