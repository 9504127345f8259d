"""Pricing of the tree search (`eval/tree_frontier.py`, step 4): each tree's step cost on this
machine, and the tokens per second of a simulated decode.

tokens/s = tokens / (prefill + sum of step costs), the step cost of a tree being the time of its
own verifier forward (root + drafts + masks, gate on the masks, LM head on the rows the decoder
computes) on a `--cache-len` cache, interleaved with the empty step and plain AR's 1-row step,
on the kernels `eval/bench.py` decodes with (`--linear`, default auto: the per-machine kernel
plan, the gated copy's its own); prefill timed on the mean prompt. Each forward is then read off
the cost curve of its rows (`cost_curve`) rather than its own noisier median; plus the drafting
of the tree from a block of that forward's outputs (the drafter's own `candidates`: top-k reads,
sampler calls, mask rows' LM head where the forward skipped it). The rest of a step (the path
value, the verifier's bookkeeping) is not in it: `eval/bench.py` measures the real thing.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time
from typing import Callable

import torch
from tqdm import tqdm

from mtpkit.eval.tree_search.calibration import Calibration
from mtpkit.eval.tree_search.simulate import Rollout
from mtpkit.models.decoding.decoder import Target
from mtpkit.models.decoding.verify import attention_inputs
from mtpkit.models.trees import Topology, compile_topology


def device_clock(device: torch.device) -> Callable[[], float]:
    """time.perf_counter, after waiting for `device`'s queued work (a GPU runs asynchronously)."""
    if device.type != "cuda":
        return time.perf_counter

    def clock() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()
    return clock


@torch.no_grad()
def step_costs(target: Target, topologies: list[Topology], k: int, prompt_len: int, cache_len: int,
               rounds: int, candidates: Callable | None = None, with_masks: bool = True) -> tuple[dict, dict]:
    """Seconds of one verifier forward of every topology with blocks of every size from its depth
    to k (`NAME@B`), of the empty step (`none@B`), AR's 1-row step (`ar`) and the prefill,
    interleaved over `rounds` rounds on a `cache_len` cache. `with_masks=False` (MTPC): no mask
    blocks, the steps `NAME@0` and `none@0` (one row: a kept bonus's state). With `candidates` (the
    drafter's `candidates(step, rows, compiled)`), also the drafting of each tree from a block of
    that forward's outputs (`draft:NAME@B`: top-k reads, sampler calls, LM-head rows the forward
    did not compute). Returns (costs, measured): measured = every item's median; costs = the same
    with each forward read off the cost curve (`cost_curve`)."""
    from transformers import DynamicCache

    from mtpkit.models.decoding.drafter import StepOutput

    vocab, d = target.embed.weight.shape
    clock = device_clock(target.device)
    masks = torch.zeros(1, d, dtype=target.dtype, device=target.device)
    ctx = torch.randint(0, vocab, (cache_len,), device=target.device)[None]
    base = DynamicCache(config=target.config)
    target.body(input_ids=ctx, past_key_values=base, use_cache=True)

    def shapes():
        yield "ar", [-1], 0, None
        for block in range(1, k + 1) if with_masks else [0]:
            yield f"none@{block}", [-1] + list(range(block)), block, None
        for t in topologies:
            for block in range(max(t.depth, 1), k + 1) if with_masks else [0]:
                c = compile_topology(t, block)
                yield f"{t.name}@{block}", list(c.full_parents), len(c.full_parents) - 1 - t.num_nodes, c

    def head_rows(Q: int, extras: int) -> int:  # LM-head rows `run` computes with the forward
        return Q if Q <= target.prefetch_rows else 1 + max(1, Q - extras)

    def run(parents, extras, compiled=None):
        cache = copy.deepcopy(base)
        Q = len(parents)
        ids = torch.randint(0, vocab, (Q - extras,), device=target.device)
        embeds = target.embed(ids)[None]
        if extras:
            embeds = torch.cat([embeds, masks.repeat(extras, 1)[None]], 1)
        mask, pos = attention_inputs(tuple(parents), cache_len, target.dtype, target.device)
        gate = contextlib.nullcontext()
        if target.gate is not None and extras:  # the adapter on the masks, as the decoder does
            gate = target.gate(torch.arange(Q)[None] >= Q - extras)
        t0 = clock()
        with gate:
            h = target.body(inputs_embeds=embeds, attention_mask=mask, position_ids=pos, past_key_values=cache,
                            use_cache=True).last_hidden_state[0]
        every = target.lm_head(h[: head_rows(Q, extras)]).float()
        seconds = clock() - t0
        if compiled is None:
            return seconds, None

        def logits(rows):  # as the decoder's: rows it computed with the forward, the others now
            return torch.stack([every[r] if r < len(every) else target.lm_head(h[r]).float() for r in rows])

        step = StepOutput(accepted=[], last_node=0, new_tokens=[int(ids[0])], hidden=h, logits=logits)
        t0 = clock()
        candidates(step, compiled.block_rows[compiled.topology.block_nodes[0]], compiled)  # any block: k rows
        return seconds, clock() - t0

    def prefill():
        cache = DynamicCache(config=target.config)
        ids = torch.randint(0, vocab, (prompt_len + (k if with_masks else 0),), device=target.device)[None]
        t0 = clock()
        target.body(input_ids=ids, past_key_values=cache, use_cache=True)
        return clock() - t0

    items = list(shapes())
    times = {name: [] for name, _, _, _ in items}
    times["prefill"] = []
    for _ in tqdm(range(rounds + 1), desc="step costs", unit="round"):
        for name, parents, extras, compiled in items:
            forward, drafting = run(parents, extras, compiled if candidates is not None else None)
            times[name].append(forward)
            if drafting is not None:
                times.setdefault("draft:" + name, []).append(drafting)
        times["prefill"].append(prefill())
    times = {name: v[1:] for name, v in times.items()}  # the first round warms up
    measured = {name: statistics.median(v) for name, v in times.items()}
    gate = target.gate is not None  # `run` switches the adapter on for the masks
    rows = {name: (len(parents), head_rows(len(parents), extras), gate and extras > 0)
            for name, parents, extras, _ in items}
    return {**measured, **cost_curve(times, rows, body_head_ratio(target))}, measured


def body_head_ratio(target: Target) -> float:
    """Parameters of the body (embeddings excluded: a lookup) over the next-token LM head's
    (vocab x d): the work of a body row in LM-head rows."""
    vocab, d = target.embed.weight.shape
    embed = {id(target.embed.weight)}
    body = sum(p.numel() for p in target.body.parameters() if id(p) not in embed)
    return body / (vocab * d)


def cost_curve(samples: dict[str, list[float]], rows: dict[str, tuple[int, int, bool]], ratio: float) -> dict:
    """The forward costs read off one cost curve instead of each shape's own median: a forward's
    time depends on its rows (Q through the body, L through the LM head, and whether the gate
    switches the adapter on), not on which tree gave them, so the samples of all shapes with the
    same `rows[name]` = (Q, L, gated) are pooled into one median, and the medians are made
    non-decreasing in the work ratio * Q + L (pool-adjacent-violators, weighted by samples), gated
    and ungated forwards apart. A shape's own median carries the machine's timing noise, which
    reorders trees whose taus differ by less; on the curve a forward of more work never costs less."""
    out = {}
    for gated in (False, True):
        keys = sorted({r for r in rows.values() if r[2] == gated}, key=lambda r: (ratio * r[0] + r[1], r))
        blocks = []  # [value, weight, keys]
        for key in keys:
            pooled = [x for name, r in rows.items() if r == key for x in samples[name]]
            blocks.append([statistics.median(pooled), len(pooled), [key]])
            while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
                (v1, w1, k1), (v2, w2, k2) = blocks.pop(-2), blocks.pop()
                blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, k1 + k2])
        value = {key: v for v, _, ks in blocks for key in ks}
        out.update({name: value[r] for name, r in rows.items() if r[2] == gated})
    return out


def kernel_summary(record: dict | None) -> dict | None:
    """The kernel plans the step costs were timed on (`pack_targets`' record): the target's and
    the gated copies'."""
    if record is None:
        return None
    return {"plans": record["plans"], "adapted": [a["plans"] for a in record.get("adapted", [])],
            "measured_at": record["measured_at"]}


def switch_cost(bank: list[Topology], k: int, cache_len: int, dtype, reps: int = 200) -> dict:
    """Microseconds per step, median over `reps` steps cycling through the bank: choosing a tree
    (`TopologyBank.get`), the step's attention inputs from its precompiled layout, and the same
    built from the parents list (what a bank saves)."""
    from mtpkit.models.trees import TopologyBank, tree_layout

    compiled = TopologyBank(bank, k)
    build = getattr(tree_layout, "__wrapped__", tree_layout)  # uncached

    def timed(fn) -> float:
        samples = []
        for i in range(reps):
            t0 = time.perf_counter()
            fn(i % len(compiled))
            samples.append(time.perf_counter() - t0)
        return round(1e6 * statistics.median(samples), 2)

    return {"choose_tree_us": timed(lambda i: compiled.get(i)),
            "mask_from_bank_us": timed(lambda i: attention_inputs((), cache_len, dtype, layout=compiled.get(i).layout)),
            "mask_rebuilt_us": timed(lambda i: attention_inputs((), cache_len, dtype,
                                                                layout=build(compiled.get(i).full_parents)))}


def tokens_per_s(sim: Rollout, cals: list[Calibration], costs: dict, trees: list[Topology]) -> float:
    seconds = len(cals) * sim.replicas * costs["prefill"]
    for used in sim.trees_used:
        name = f"none@{sim.block}" if used is None else f"{trees[used].name}@{sim.block}"
        seconds += costs[name] + costs.get("draft:" + name, 0.0)  # the tree drafted for this step
    return sim.tokens / seconds
