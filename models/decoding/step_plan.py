"""Which decoding step `auto` runs, per machine: captured graphs on CUDA (plain AR's compiled
first); on a CPU compiled steps only where they were measured faster here.

On CUDA a step is host-bound: a graph replay costs per kernel, and compiling the step first fuses
its elementwise kernels, so plain AR's step runs compiled and captured (`compile_graph`: one
compilation, its seconds reported apart). Drafters' steps are captured uncompiled (`graph`) until
their compiled steps are measured on a GPU; `step=compile_graph` asks for it by hand.

On a CPU `torch.compile`'s step pays on some machines and not on others, and it costs a
compilation per step shape (about a minute on 2 cores). So on a CPU `auto` compiles a method's
steps only when

- its drafter has few step shapes (`few_shapes`: plain AR, and gated LoRA's linear and quadratic
  chains; a probe's or prompt lookup's steps change shape with their drafts, one compilation
  each), and
- a bench run on this machine, model and dtype measured AR's compiled step faster than its eager
  step in one interleaved run (`--methods ar ar:step=compile ...`; the bench records both step
  times here, beside the kernel plan: `$MTPKIT_KERNEL_CACHE/<machine>/steps-<model>.json`),

and runs eager steps otherwise. `--step eager` or `compile` chooses by hand.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from mtpkit.models.atomic_write import write_atomic
from mtpkit.models.decoding.drafter import Drafter
from mtpkit.models.kernel_plan import _key, kernel_cache, machine_info

GAIN = 0.97  # compiled steps are chosen when AR's compiled step takes at most this share of its eager one


def model_key(model) -> dict:
    """What a step time depends on beside the machine: the model's class, dtype and size."""
    weight = model.get_input_embeddings().weight
    return {"class": type(model).__name__, "dtype": str(weight.dtype).removeprefix("torch."),
            "parameters": sum(p.numel() for p in model.parameters())}


def plan_path(model) -> Path:
    return kernel_cache() / _key(machine_info()) / f"steps-{_key(model_key(model))}.json"


def recorded(model) -> dict | None:
    """The step times a bench recorded for `model` on this machine, or None."""
    try:
        return json.loads(plan_path(model).read_text())
    except (OSError, ValueError):
        return None


def record(model, eager_ms: float, compiled_ms: float, compile_s: float) -> dict:
    """Keep AR's eager and compiled step times (ms) measured in one run, and what `auto` makes of them."""
    entry = {"machine": machine_info(), "model": model_key(model), "eager_ms": eager_ms,
             "compiled_ms": compiled_ms, "compile_s": compile_s, "compile": compiled_ms <= GAIN * eager_ms,
             "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    path = plan_path(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(entry, indent=1))
    return entry


def plain_ar(drafter) -> bool:
    """Whether `drafter` never drafts (plain AR: the base `Drafter.propose`)."""
    return drafter is not None and type(drafter).propose is Drafter.propose


def few_shapes(drafter) -> bool:
    """Whether `drafter`'s steps take few shapes (a compilation each): plain AR's one, else the
    drafter's own `few_shapes` (False when it has none)."""
    return plain_ar(drafter) or bool(getattr(drafter, "few_shapes", False))


def cuda_step(drafter) -> str:
    """`auto` on CUDA: plain AR's step compiled and captured, every drafter's captured."""
    return "compile_graph" if plain_ar(drafter) else "graph"


def cpu_step(model, drafter) -> str:
    """What `--step auto` runs on a CPU for `drafter` on `model` (see the module docstring)."""
    found = recorded(model)
    return "compile" if found and found.get("compile") and few_shapes(drafter) else "eager"
