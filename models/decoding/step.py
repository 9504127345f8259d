"""One step per tree shape, fixed in shape: what a captured CUDA graph or `torch.compile` runs.

A decoding step after the prefill feeds the target [root, draft nodes..., extra nodes...] in the
layout of its tree. For a given shape (the tree's layout, N draft nodes, M extra nodes) every
tensor of that forward has a fixed size when the KV cache is a `StaticSlab` (gpt-fast's layout):
the rows are written by index at device positions, attention reads the whole slab, and the
mask that hides the positions past the step is built on the device from the cache length, a
device scalar. `ShapeStep` holds one shape's input buffers (ids, extra embeddings) and runs

    mask, positions, write index from `length_t` -> embed -> body (gated suffix) -> LM head
    -> every row's logits and argmax

with no host read and no host-to-device copy inside, so it can be

- `static`:  run eagerly (the same computation; the modes below are tested against it),
- `graph`:   captured as a CUDA graph at its first use and replayed (CUDA only; graphs share
             one memory pool; the slab and the buffers are the Target's, so the captured
             addresses stay valid for every prompt),
- `compile`: run under `torch.compile` (one compilation per shape; on a CPU it pays only where
             it measures faster than the eager kernels: bench runs with `--step compile` and
             `--step eager` show which),
- `compile_graph`: compiled (its elementwise ops fused into fewer kernels), then captured as a
             CUDA graph and replayed (CUDA only; gpt-fast's `mode="reduce-overhead"`): a replay
             costs per kernel, so fewer kernels is a shorter step where the step is host-bound.

`eager` (no `ShapeStep`: the decoder's dynamic-shape forward on the growing slab) stays the
exactness oracle. The prefill (the prompt) is always eager, on the same slab.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import torch

from mtpkit.models.decoding.cache import StaticSlab

STEPS = ("eager", "static", "graph", "compile", "compile_graph")
GRAPHED = ("graph", "compile_graph")  # the modes that capture CUDA graphs
COMPILED = ("compile", "compile_graph")  # the modes that run the step under torch.compile


STEP_CHOICES = ("auto",) + STEPS  # what `--step` takes

# `compile`: one whole graph a step (a graph break inside it fails instead of running the step in
# pieces), its shapes fixed
COMPILE = {"fullgraph": True, "dynamic": False}


@dataclasses.dataclass
class StepOptions:
    """The decoding-step option every decoder method takes (keyword only, after its own)."""
    step: str = dataclasses.field(default="", kw_only=True)
    """this method's decoding step (auto, eager, static, compile, graph; '' = the bench's --step): `ar
    ar:step=compile pld pld:step=compile` compares eager and compiled steps in one interleaved run"""


def resolve_step(step: str, device: torch.device, model=None, drafter=None) -> str:
    """`auto`: on CUDA captured graphs, plain AR's compiled first (`step_plan.cuda_step`); on a CPU
    compiled steps where this machine measured them faster for `model` and `drafter` has few step
    shapes (`step_plan.cpu_step`), else eager. Any other mode as given."""
    if step != "auto":
        return step
    from mtpkit.models.decoding.step_plan import cpu_step, cuda_step
    if torch.device(device).type == "cuda":
        return cuda_step(drafter)
    if model is None:  # nothing measured to go by
        return "eager"
    return cpu_step(model, drafter)


def check_step(step: str, device: torch.device) -> None:
    """Refuse a step mode the device cannot run, in one line."""
    if step not in STEPS:
        raise ValueError(f"unknown step {step!r}; choose one of {', '.join(STEPS)}")
    if step in GRAPHED and torch.device(device).type != "cuda":
        raise ValueError(f"step {step!r} captures CUDA graphs; the target is on {device} (use static or compile)")


class ShapeStep:
    """One step shape's fixed buffers and forward (see the module docstring)."""

    def __init__(self, target, cache, layout: tuple[torch.Tensor, torch.Tensor], n_ids: int, n_extras: int,
                 hidden_states: bool, mode: str, pool=None):
        device = target.device
        self.target, self.cache, self.mode, self.pool = target, cache, mode, pool
        self.allowed, self.depth = layout  # on the device: [Q, Q] bool, [Q] long
        self.n_ids, self.Q = n_ids, n_ids + n_extras
        self.hidden_states = hidden_states
        self.ids = torch.zeros(n_ids, dtype=torch.long, device=device)
        self.extras = (torch.zeros(n_extras, target.embed.weight.shape[1], dtype=target.dtype, device=device)
                       if n_extras else None)
        self.write = torch.zeros(self.Q, dtype=torch.long, device=device)
        self.columns = torch.arange(cache.capacity, device=device)
        self.rows = torch.arange(self.Q, device=device)
        self.lowest = torch.finfo(target.dtype).min
        self.graph = None
        self.outputs = None
        self.compile_seconds = 0.0
        self.fn = torch.compile(self.forward, **COMPILE) if mode in COMPILED else self.forward

    def forward(self):
        """Every row's (hidden, logits, argmax, shared hidden states or None) of this shape's step."""
        target, cache, Q = self.target, self.cache, self.Q
        length = cache.length_t
        relative = self.columns - length  # [capacity]: a column's place in the step (< 0: the past)
        in_step = (relative >= 0) & (relative < Q)
        visible = self.allowed.index_select(1, relative.clamp(0, Q - 1)) & in_step
        visible |= (self.columns < length)[None]
        mask = torch.zeros((Q, self.columns.numel()), dtype=target.dtype, device=self.columns.device)
        mask = mask.masked_fill(~visible, self.lowest)
        self.write.copy_(self.rows + length)
        embeds = target.embed(self.ids)
        if self.extras is not None:
            embeds = torch.cat([embeds, self.extras])
        gated = contextlib.nullcontext()
        if target.gate is not None:  # the adapter is on for the extra nodes (mask tokens) only
            gated = target.gate.suffix(self.n_ids, Q, device=self.columns.device)
        with gated:
            out = target.body(inputs_embeds=embeds[None], attention_mask=mask[None, None],
                              position_ids=(self.depth + length)[None], past_key_values=cache.hf, use_cache=True,
                              output_hidden_states=self.hidden_states)
        hidden = out.last_hidden_state[0]
        logits = target.lm_head(hidden).float()
        shared = out.hidden_states if self.hidden_states else None
        return hidden, logits, logits.argmax(-1), shared

    def _capture(self) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: compilation, lazy inits and allocator state outside the capture
            for _ in range(2):
                self.fn()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=self.pool):
            self.outputs = self.fn()

    def run(self, ids: torch.Tensor, extras: torch.Tensor | None):
        """The step on `ids` ([n_ids] on the device: root, draft tokens) and `extras` ([M, d])."""
        self.ids.copy_(ids, non_blocking=True)
        if self.extras is not None:
            self.extras.copy_(extras, non_blocking=True)
        self.cache.write = self.write
        try:
            if self.mode in GRAPHED:
                if self.graph is None:
                    started = time.perf_counter()
                    self._capture()
                    self.compile_seconds += time.perf_counter() - started
                self.graph.replay()
                return self.outputs
            if self.mode == "compile" and self.outputs is None:  # the first call compiles
                started = time.perf_counter()
                self.outputs = self.fn()
                self.compile_seconds += time.perf_counter() - started
                return self.outputs
            self.outputs = self.fn()
            return self.outputs
        finally:
            self.cache.write = None


class StepBank:
    """A Target's `ShapeStep`s, one per (layout, draft nodes, extra nodes, hidden states), made at
    first use, and the `StaticSlab` they all write (one per Target, reused by every prompt)."""

    def __init__(self, target, mode: str, max_len: int):
        check_step(mode, target.device)
        self.target, self.mode = target, mode
        self.cache = StaticSlab(target.config.num_hidden_layers, max_len, target.upload)
        self.steps: dict[tuple, ShapeStep] = {}
        self.pool = torch.cuda.graph_pool_handle() if mode in GRAPHED else None

    @property
    def compile_seconds(self) -> float:
        """Seconds spent capturing or compiling steps so far (apart from decoding)."""
        return sum(s.compile_seconds for s in self.steps.values())

    def begin(self, rows: int) -> StaticSlab:
        """The slab emptied for a prompt whose decode needs `rows` positions at most."""
        cache = self.cache
        if rows > cache.capacity:
            raise ValueError(f"a prompt and reply of {rows} positions do not fit the static cache's "
                             f"{cache.capacity}; raise max_len (Target(max_len=...), --max-len)")
        cache.length = 0
        if cache.length_t is not None:
            cache.length_t.fill_(0)
        return cache

    def step(self, parents: tuple[int, ...], layout, n_ids: int, n_extras: int, hidden_states: bool) -> ShapeStep:
        """The step of the tree `parents` (the whole step's: -1 for the root), made at first use."""
        key = (parents, n_ids, n_extras, hidden_states)
        found = self.steps.get(key)
        if found is None:
            found = ShapeStep(self.target, self.cache, layout, n_ids, n_extras, hidden_states, self.mode, self.pool)
            self.steps[key] = found
        return found

