"""What a decoding step's rows cost by themselves: the floor a drafter's step is measured against.

A step of a method feeds R rows (root, drafts, masks) to the target; a plain forward of R new
rows on the same target and kernels (the body on a KV cache, then the LM head over every row, no
gate, no drafting, no acceptance) is the least that step can cost. A decode's steps feed
different R, and a kernel's cost is not linear in R (a CPU's kernel plan changes kernel with the
row count), so a decode's floor is the mean of its steps' own row counts' forwards (the most
frequent few, weighted by their steps: `RowsFloor.mix`; each the median of 3 forwards), and its
steps are taken the same way: the median step of each of those row counts (`step_mix`), so both
sides are one statistic (a host stall that lengthens a few steps moves a mean, not a median).
The bench divides the one by the other per decode (`x_rows`: 1.00 would be a loop with no
overhead at all), and the same without the method's own model work (`x_loop`): the drafter's time
taken out of its steps, a gated adapter's mask rows gated in the floor (`RowsFloor.own`), and each
floor forward run right after the drafter's draft done again, untimed (`Drafter.redo_draft`): a
step's forward follows its draft, whose reads (MTPC's circuit head, larger than the backbone) have
evicted the backbone's weights from the caches, and the floor's forward then meets the same caches.
It times the floor between its decodes, so the floor runs in the same conditions as the steps it
divides (caches, clocks and load change over a run: a floor timed in a tight loop after the run is
faster than the same forward inside it). `mtpkit.eval.report.FLOOR_VERSION` names this statistic.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch

from mtpkit.eval.device_probe import sync
from mtpkit.models.decoding.cache import SlabCache, new_cache
from mtpkit.models.decoding.decoder import DecodeResult, Target
from mtpkit.models.decoding.drafter import Drafter
from mtpkit.models.decoding.verify import attention_inputs
from mtpkit.models.trees import tree_layout


class RowsFloor:
    """Plain forwards of R new rows after `cache_len` cached positions on `target`, timed one at a
    time on demand (the prompt is prefilled once; each forward's rows are dropped again)."""

    def __init__(self, target: Target, cache_len: int, max_rows: int = 64, longest: int = 0):
        """For caches of up to `longest` positions (at least `cache_len`), set to `cache_len` (`at`
        moves it)."""
        self.target, self.max_rows = target, max_rows
        generator = torch.Generator().manual_seed(0)
        vocab = target.embed.weight.shape[0]
        self.longest = max(cache_len, longest)
        self.past = torch.randint(0, vocab, (1, self.longest), generator=generator).to(target.device)
        self.new = torch.randint(0, vocab, (1, max_rows), generator=generator).to(target.device)
        self.cache = None
        self.warm: set[tuple[int, int]] = set()
        self.cache_len = -1
        self.at(cache_len)

    @torch.no_grad()
    def at(self, cache_len: int) -> None:
        """Forwards after `cache_len` cached positions from now on (at most `longest`): a step
        attends to its whole cache, so a decode's floor is taken at its own cache length. A slab is
        prefilled once for `longest` and moved down and up (the positions past it keep the last
        forward's rows: values that time the same); another cache (one that cannot grow back, or
        roll back across EvaByte's window end) is prefilled again at each length."""
        if not 0 < cache_len <= self.longest:
            raise ValueError(f"RowsFloor.at({cache_len}): the floor was made for 1..{self.longest} positions")
        if cache_len == self.cache_len:
            return
        if self.cache is None or not isinstance(self.cache, SlabCache):
            target = self.target
            self.cache = new_cache(target.cache, target.config, self.longest + self.max_rows)
            fill = self.longest if isinstance(self.cache, SlabCache) else cache_len
            target.body(input_ids=self.past[:, :fill], past_key_values=self.cache.hf, use_cache=True)
            self.cache.compact(fill, [])
        self.cache.compact(cache_len, [])
        self.cache_len = cache_len
        # on EvaByte a step stays in its attention window (`draft_room`): rows past its end sit at its last position
        room = self.target.adapter.draft_room(cache_len)
        self.windowed = room is not None
        max_rows = self.max_rows
        self.positions = (cache_len + torch.arange(max_rows).clamp(max=max_rows if room is None else room))[None].to(
            self.target.device)
        self.masks: dict[int, torch.Tensor] = {}

    def mask(self, rows: int) -> torch.Tensor | None:
        """A chain of `rows` rows' additive mask, as the decoder gives a step of several rows (the
        model's own would be a boolean one, converted in every layer); None for one row, and on a
        target whose steps keep to an attention window (EvaByte: its own attention and masks)."""
        if rows == 1 or self.windowed:
            return None
        found = self.masks.get(rows)
        if found is None:
            layout = tree_layout(tuple(range(-1, rows - 1)))
            found = self.masks[rows] = attention_inputs((), self.cache_len, self.target.dtype, self.target.device,
                                                        layout=layout)[0]
        return found

    @property
    def own(self) -> bool:
        """Whether the target's own work differs from plain rows: a gated adapter, on for a step's
        extra rows (its mask tokens); their forward is then timed apart for `x_loop`."""
        return self.target.gate is not None

    @torch.no_grad()
    def forward(self, rows: int, gated: int = 0) -> None:
        """`rows` new rows; with `gated`, the adapter on for the last `gated` of them, as a step gates
        its mask tokens."""
        target = self.target
        context = target.gate.suffix(rows - gated, rows) if gated and self.own else contextlib.nullcontext()
        with context:
            hidden = target.body(input_ids=self.new[:, :rows], position_ids=self.positions[:, :rows],
                                 attention_mask=self.mask(rows), past_key_values=self.cache.hf,
                                 use_cache=True).last_hidden_state[0]
        target.lm_head(hidden)
        self.cache.compact(self.cache_len, [])  # drop the rows again

    def mix(self, shapes: dict[tuple[int, int], int], gated: bool = False, before=None) -> float:
        """The floor of a decode's steps of `shapes` ((rows, extras) -> steps, as `top_shapes` picks
        them), in ms: each shape's forward, weighted by its steps; with `gated`, each shape's extra
        rows gated (the adapter's own work in the floor); `before` as `ms` takes it."""
        return sum(n * self.ms(rows, extras if gated else 0, before=before) for (rows, extras), n in shapes.items()) \
            / sum(shapes.values())

    def ms(self, rows: int, gated: int = 0, repeats: int = 3, before=None) -> float:
        """The median of `repeats` timed forwards of `rows` rows (`gated` of them gated), in ms (a
        shape's first call is a warm-up first): one forward's time wanders by several percent on a
        CPU, more than the loop's overhead that the floor is there to show. `before`, a callable,
        runs before each forward, untimed (a drafter's `redo_draft`)."""
        device = self.target.device
        if (rows, gated) not in self.warm:
            self.forward(rows, gated)
            self.warm.add((rows, gated))
        times = []
        for _ in range(repeats):
            if before is not None:
                before()
            sync(device)
            started = time.perf_counter()
            self.forward(rows, gated)
            sync(device)
            times.append(1000 * (time.perf_counter() - started))
        return statistics.median(times)


def top_shapes(result: DecodeResult, most: int = 4) -> dict[tuple[int, int], int]:
    """A decode's `most` most frequent step shapes, (rows, extras) -> steps (prefill out); {} without a step."""
    counts: dict[tuple[int, int], int] = {}
    for rows, extras, _, _ in result.step_times:
        counts[rows, extras] = counts.get((rows, extras), 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:most])


def step_mix(result: DecodeResult, shapes: dict[tuple[int, int], int], drafting: bool = False) -> float:
    """A decode's steps over `shapes` in ms, as `RowsFloor.mix` takes its forwards: each shape's
    median step, weighted by its steps; with `drafting` False, each step less its drafter's time."""
    total = 0.0
    for shape, n in shapes.items():
        times = [seconds - (0.0 if drafting else drafted)
                 for rows, extras, seconds, drafted in result.step_times if (rows, extras) == shape]
        total += n * 1000 * statistics.median(times)
    return total / sum(shapes.values())


def redoes_draft(drafter: Drafter | None) -> bool:
    """Whether `drafter` has a draft to redo (`Drafter.redo_draft` overridden)."""
    return drafter is not None and type(drafter).redo_draft is not Drafter.redo_draft


def decode_floors(floor: RowsFloor, result: DecodeResult, prompt_len: int,
                  drafter: Drafter | None = None) -> dict | None:
    """One decode of a `prompt_len`-token prompt against its floors, timed now at its mean cache
    length: `rows` (its shapes' plain forwards), `own` (gated as its steps gate them, each after
    `drafter`'s last draft redone; the plain ones for a method with neither), `step` (its median
    steps) and `loop` (the same less the drafter's time), in ms; None without a decoding step."""
    shapes = top_shapes(result)
    if not shapes:
        return None
    floor.at(min(prompt_len + len(result.tokens) // 2, floor.longest))
    rows = floor.mix(shapes)
    gated = floor.own and any(extras for _, extras in shapes)
    redo = redoes_draft(drafter)
    own = floor.mix(shapes, gated=gated, before=drafter.redo_draft if redo else None) if gated or redo else rows
    return {"rows": rows, "own": own, "step": step_mix(result, shapes, drafting=True),
            "loop": step_mix(result, shapes)}
