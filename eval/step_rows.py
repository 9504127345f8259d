"""What a decoding step's rows cost by themselves: the floor a drafter's step is measured against.

A step of a method feeds R rows (root, drafts, masks) to the target; a plain forward of R new
rows on the same target and kernels (the body on a KV cache, then the LM head over every row, no
gate, no drafting, no acceptance) is the least that step can cost. A decode's steps feed
different R, and a kernel's cost is not linear in R (a CPU's kernel plan changes kernel with the
row count), so a decode's floor is the mean of its steps' own row counts' forwards (the most
frequent few, weighted by their steps: `RowsFloor.mix`; each the median of 3 forwards). The bench
divides each method's mean decoding-step time by it (`x_rows`): 1.00 would be a loop with no overhead at all.
It times the floor between its decodes (`RowsFloor`), so the floor runs in the same conditions as
the steps it divides (caches, clocks and load change over a run: a floor timed in a tight loop
after the run is faster than the same forward inside it).
"""

from __future__ import annotations

import statistics
import time

import torch

from mtpkit.eval.device_probe import sync
from mtpkit.models.decoding.cache import new_cache
from mtpkit.models.decoding.decoder import DecodeResult, Target
from mtpkit.models.decoding.verify import attention_inputs
from mtpkit.models.trees import tree_layout


class RowsFloor:
    """Plain forwards of R new rows after `cache_len` cached positions on `target`, timed one at a
    time on demand (the prompt is prefilled once; each forward's rows are dropped again)."""

    def __init__(self, target: Target, cache_len: int, max_rows: int = 64):
        self.target, self.cache_len = target, cache_len
        device = target.device
        generator = torch.Generator().manual_seed(0)
        vocab = target.embed.weight.shape[0]
        past = torch.randint(0, vocab, (1, cache_len), generator=generator).to(device)
        self.new = torch.randint(0, vocab, (1, max_rows), generator=generator).to(device)
        # on EvaByte a step stays in its attention window (`draft_room`): rows past its end sit at its last position
        room = target.adapter.draft_room(cache_len)
        self.windowed = room is not None
        self.positions = (cache_len + torch.arange(max_rows).clamp(max=max_rows if room is None else room))[None].to(device)
        self.cache = new_cache(target.cache, target.config, cache_len + max_rows)
        with torch.no_grad():
            target.body(input_ids=past, past_key_values=self.cache.hf, use_cache=True)
        self.cache.compact(cache_len, [])
        self.warm: set[int] = set()
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

    @torch.no_grad()
    def forward(self, rows: int) -> None:
        target = self.target
        hidden = target.body(input_ids=self.new[:, :rows], position_ids=self.positions[:, :rows],
                             attention_mask=self.mask(rows), past_key_values=self.cache.hf,
                             use_cache=True).last_hidden_state[0]
        target.lm_head(hidden)
        self.cache.compact(self.cache_len, [])  # drop the rows again

    def mix(self, steps: dict[int, int], most: int = 4) -> float:
        """The floor of a decode whose steps fed `steps` (rows -> steps), in ms: one timed forward of
        each of its `most` most frequent row counts, weighted by their steps."""
        top = sorted(steps.items(), key=lambda kv: (-kv[1], kv[0]))[:most]
        return sum(n * self.ms(rows) for rows, n in top) / sum(n for _, n in top)

    def ms(self, rows: int, repeats: int = 3) -> float:
        """The median of `repeats` timed forwards of `rows` rows, in ms (a row count's first call is a
        warm-up first): one forward's time wanders by several percent on a CPU, more than the loop's
        overhead that the floor is there to show."""
        device = self.target.device
        if rows not in self.warm:
            self.forward(rows)
            self.warm.add(rows)
        times = []
        for _ in range(repeats):
            sync(device)
            started = time.perf_counter()
            self.forward(rows)
            sync(device)
            times.append(1000 * (time.perf_counter() - started))
        return statistics.median(times)


def decode_rows(result: DecodeResult) -> dict[int, int] | None:
    """A decode's rows a decoding step -> its number of steps (the prefill step left out); None without one."""
    return dict(result.step_rows) or None
