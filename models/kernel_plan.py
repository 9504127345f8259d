"""The kernel of every packed product, per row count, measured on this machine.

Which kernel multiplies m rows fastest (`mtpkit.models.packed_linear.KERNELS`: torch's own
unfused layers, `F.linear` on the fused siblings' stacked weight, oneDNN's prepacked product, the
same over rows padded to the 4 it was packed for)
depends on the CPU, the weight's shape and m; the decoder calls the target with 1 row (AR) and
2-64 rows (drafts, trees, prefill chunks). `tune` times whole decoding steps (body forward on a
KV cache, then the LM head on every new row) on the model itself, for every row count in `ROWS`
and every pair of kernels for the body's products and the LM head's, interleaved so that
machine drift hits all alike, picks the fastest pair per row count (keeping the previous count's
pair while it is within `KEEP` of the fastest, and at 1 row torch's own layers while they are
within `STOCK_KEEP`, so noise does not flip the plan) and sets it on
every group (`PackedGroup.plan`) of the model and of every other target given (adapted copies of
it). A row count between two measured ones takes the choice of the lower one; above the last,
the last one's.

A gated-LoRA copy (groups carrying a gate) gets a plan of its own, timed on the copy with its
adapter on for the last `gated_rows(m)` rows of every step (about a third: linear decoding with
k = 1 verifies 3 rows, one of them a mask): its products are wider (the A rows ride along), and
on torch's own layers every gated linear adds 2 small products where a fused group adds one
addmm, so its best kernel per row count can differ from the plain model's.

The result is cached per machine (CPU model, core and thread count, torch build), model (class,
shapes) and dtype under `$MTPKIT_KERNEL_CACHE` (default `$MTPKIT_CACHE/kernels`), so only the
first run on a machine pays for the timing; `retune=True` (`--retune` in the bench
scripts) measures again. `eval/bench_forward.py` prints the table a plan came from.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

from mtpkit.models.attention import use_grouped_sdpa
from mtpkit.models.backbone import cache_dir
from mtpkit.models.atomic_write import write_atomic
from mtpkit.models.packed_linear import KERNELS, PACK_ROWS, PackedGroup, PackedLinear, cpu_paths, pack_linears

ROWS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 64)  # row counts timed (steps, trees, prefill)
REPS = 7  # timed rounds per (row count, kernel pair); the first is warm-up
KEEP = 0.02  # a row count keeps the previous count's pair while it is within 2% of the fastest
STOCK_KEEP = 0.05  # 1 row keeps torch's own layers while they are within 5% of the fastest
CACHE_LEN = 200  # tokens in the KV cache the body forwards run on
MIN_SAMPLE_S = 0.03  # a timing sample averages enough steps to last this long (tiny models)
CLASSES = ("body", "head")
FORMAT = 5  # version of the cached JSON (older plans are measured again)


def kernel_cache() -> Path:
    return Path(os.environ.get("MTPKIT_KERNEL_CACHE", cache_dir() / "kernels")).expanduser()


def groups_of(model: nn.Module) -> dict[str, list[PackedGroup]]:
    """The packed groups of `model` by class: `head` (the output embedding's) and `body`."""
    head = model.get_output_embeddings()
    head_group = head.group if isinstance(head, PackedLinear) else None
    seen, out = set(), {c: [] for c in CLASSES}
    for module in model.modules():
        group = getattr(module, "group", None)
        if isinstance(group, PackedGroup) and id(group) not in seen:
            seen.add(id(group))
            out["head" if group is head_group else "body"].append(group)
    return out


def machine_info() -> dict:
    """What decides kernel speed here: the CPU, its cores, torch's threads and build."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count() or 1, "threads": torch.get_num_threads(),
            "torch": torch.__version__, "onednn": torch.backends.mkldnn.is_available()}


def model_info(model: nn.Module) -> dict:
    """What decides the plan of `model`: its class, dtype, the shapes of its groups and (a gated
    copy) the LoRA width of each gated group."""
    classes = groups_of(model)
    info = {"class": type(model).__name__, "dtype": str(model.get_input_embeddings().weight.dtype).removeprefix("torch."),
            "groups": {c: sorted({(g.out_features, g.weights[0].shape[1]) for g in gs}) for c, gs in classes.items()}}
    lora = sorted({(g.out_features, g.weights[0].shape[1], sum(At.shape[1] for At, _ in g.lora))
                   for gs in classes.values() for g in gs if g.lora})
    if lora:
        info["lora"] = lora
    return info


def gate_of(model: nn.Module):
    """The gate of a gated-LoRA copy's packed groups (`Gate`), or None for a plain model."""
    return next((g.gate for gs in groups_of(model).values() for g in gs if g.gate is not None), None)


def gated_rows(m: int) -> int:
    """How many of a timed m-row step's rows (the last ones) a gated copy's adapter is on for."""
    return -(-m // 3)


def _key(info: dict) -> str:
    return hashlib.sha1(json.dumps(info, sort_keys=True).encode()).hexdigest()[:16]


def cache_path(model: nn.Module) -> Path:
    return kernel_cache() / _key(machine_info()) / f"{_key(model_info(model))}.json"


def expand(choice: dict[int, str], rows: list[int]) -> tuple[str, ...]:
    """A plan (kernel per row count 1..max(rows)) from the choices at the measured `rows`: each
    count takes the choice of the largest measured count not above it (the smallest one below
    the first)."""
    rows = sorted(rows)
    plan = []
    for m in range(1, rows[-1] + 1):
        below = [r for r in rows if r <= m]
        plan.append(choice[below[-1] if below else rows[0]])
    return tuple(plan)


def combos(classes: dict[str, list]) -> list[tuple[str, str]]:
    """The (body kernel, head kernel) pairs worth timing. An LM head is a group of one, where
    `linear` and `stock` are the same product, so it is timed as `stock` and `onednn` only."""
    heads = ("stock", "onednn", "padded") if classes.get("head") else ("stock",)
    return [(b, h) for b in KERNELS for h in heads]


def timed_at(pair: tuple[str, str], m: int) -> bool:
    """Whether a pair is timed at m rows: `padded` differs from `onednn` below `PACK_ROWS` rows only."""
    return m < PACK_ROWS or "padded" not in pair


def combo_name(body: str, head: str) -> str:
    return f"{body}/{head}"


def choose(median_ms: dict[str, dict[int, float]], keep: float = KEEP,
           stock_keep: float = STOCK_KEEP) -> dict[str, tuple[str, ...]]:
    """The plan of each class from the whole-step timings of every `body/head` pair: the fastest
    pair at every measured row count, expanded; a row count keeps the previous count's pair while
    that is within `keep` (relative) of the fastest, so timing noise between near-equal pairs does
    not flip the plan back and forth; the first count (AR's 1-row step) keeps torch's own layers,
    `stock/stock`, unless another pair is faster by more than `stock_keep`: a gain that small was
    not seen to survive in decoding, and AR on torch's layers is what transformers users get."""
    rows = sorted({m for times in median_ms.values() for m in times})
    stock = combo_name("stock", "stock")
    choice, previous = {}, stock if stock in median_ms else None
    for m in rows:
        cost = {name: times.get(m, float("inf")) for name, times in median_ms.items()}
        best = min(cost, key=cost.get)
        margin = stock_keep if m == rows[0] and previous == stock else keep
        if previous is not None and cost[previous] <= (1 + margin) * cost[best]:
            best = previous
        choice[m] = previous = best
    return {cls: expand({m: name.split("/")[i] for m, name in choice.items()}, rows)
            for i, cls in enumerate(CLASSES)}


def set_plans(model: nn.Module, plans: dict[str, tuple[str, ...] | None]) -> int:
    """Give every packed group of `model` its class's plan (None: oneDNN for every row count);
    returns how many groups."""
    n = 0
    for cls, groups in groups_of(model).items():
        for g in groups:
            g.plan = None if plans.get(cls) is None else tuple(plans[cls])
            n += 1
    return n


@torch.no_grad()
def measure(model: nn.Module, rows=ROWS, reps: int = REPS, cache_len: int = CACHE_LEN,
            progress: bool = False) -> dict[str, dict[int, float]]:
    """Median milliseconds of one decoding step over m new tokens on a `cache_len`-token KV cache
    (the body forward, then the LM head on every new row, as the decoder's prefetch computes
    it) under every `body/head` kernel pair, per row count. Whole steps, not products alone:
    a product's cost alone misses what it does to the rest of the step (a fused product's
    outputs are strided views, caches are shared). A gated-LoRA copy is timed with its adapter on
    for the last `gated_rows(m)` rows. The steps run as the decoder runs them: its body and LM
    head (`mtpkit.models.arch`) on its own cache (`new_cache`: EvaByte's EVA window cache, else the
    slab), rolled back after each; on EvaByte only the row counts whose step fits in the window
    after `cache_len` are timed (a decoding step never crosses a window end). Restores the plans."""
    from mtpkit.models.arch import adapter_for
    from mtpkit.models.decoding.cache import new_cache

    classes = groups_of(model)
    saved = {id(g): g.plan for gs in classes.values() for g in gs}
    pairs = combos(classes)
    adapter = adapter_for(model)
    body, head = adapter.body, adapter.lm_head
    room = adapter.draft_room(cache_len)  # positions after cache_len in its window (None: no window)
    rows = [m for m in rows if room is None or m <= room + 1]
    vocab = model.get_input_embeddings().weight.shape[0]
    device = model.get_input_embeddings().weight.device
    gen = torch.Generator().manual_seed(0)
    gate = gate_of(model)
    cache = new_cache("slab", model.config, cache_len + max(rows))
    body(input_ids=torch.randint(0, vocab, (1, cache_len), generator=gen).to(device), past_key_values=cache.hf,
         use_cache=True)
    cache.compact(cache_len, [])
    times = {combo_name(*pair): {m: [] for m in rows if timed_at(pair, m)} for pair in pairs}

    def step(x, b, h) -> float:
        for g in classes["body"]:
            g.plan = (b,)
        for g in classes["head"]:
            g.plan = (h,)
        m = x.shape[1]
        on = contextlib.nullcontext() if gate is None else gate(torch.arange(m)[None] >= m - gated_rows(m))
        t0 = time.perf_counter()
        with on:
            head(body(input_ids=x, past_key_values=cache.hf, use_cache=True).last_hidden_state)
        seconds = time.perf_counter() - t0
        cache.compact(cache_len, [])  # back to the cache_len tokens
        return seconds

    try:
        # a sample is the mean of `inner` steps, so that one lasts >= MIN_SAMPLE_S even on a tiny
        # model, where a single step is within the OS's own noise
        x1 = torch.randint(0, vocab, (1, 1), generator=gen).to(device)
        first = min(step(x1, "stock", "stock") for _ in range(3))
        inner = max(1, math.ceil(MIN_SAMPLE_S / max(first, 1e-6)))
        for r in range(reps):
            if progress:
                print(f"\r[kernels] timing round {r + 1}/{reps}", end="", file=sys.stderr, flush=True)
            for i, m in enumerate(rows):
                x = torch.randint(0, vocab, (1, m), generator=gen).to(device)
                here = [pair for pair in pairs if timed_at(pair, m)]
                shift = (r + i) % len(here)  # every pair takes every place in the order
                for b, h in here[shift:] + here[:shift]:
                    # untimed first: a pair's weights (the stacked or packed copies) are then as warm
                    # in the caches as in decoding, whichever pair ran before it
                    step(x, b, h)
                    times[combo_name(b, h)][m].append(sum(step(x, b, h) for _ in range(inner)) / inner)
    finally:
        for gs in classes.values():
            for g in gs:
                g.plan = saved[id(g)]
        if progress:
            print(file=sys.stderr)
    return {name: {m: 1000 * statistics.median(v[1:] if len(v) > 1 else v) for m, v in by_m.items()}
            for name, by_m in times.items()}


def tune(model: nn.Module, others=(), *, rows=ROWS, reps: int = REPS, cache_len: int = CACHE_LEN,
         retune: bool = False, log=None) -> dict | None:
    """Set on `model` and every plain model in `others` the plan measured for `model` on this
    machine, and on every gated-LoRA copy in `others` the plan measured for that copy (each cached;
    `retune` measures again). Returns the record of `model` (machine, model, rows, median_ms, plans,
    load, cached; `adapted`: the gated copies' records, if any), or None if `model` has no packed
    group."""
    if not any(groups_of(model).values()) or not cpu_paths(next(model.parameters()).device):
        return None  # nothing packed, or a GPU model (its groups run DEVICE_PLAN, nothing to measure)
    log = log or (lambda msg: print(f"[kernels] {msg}", file=sys.stderr))
    gated = [m for m in others if gate_of(m) is not None]  # each timed on its own
    others = [m for m in others if all(m is not g for g in gated)]
    adapted = [tune(m, rows=rows, reps=reps, cache_len=cache_len, retune=retune, log=log) for m in gated]
    what = "a gated-LoRA copy" if gate_of(model) is not None else "the model"
    path = cache_path(model)
    record = None
    if path.is_file() and not retune:
        try:
            record = json.loads(path.read_text())
            if record.get("format") != FORMAT:
                record = None
            else:  # JSON keys are strings
                record["median_ms"] = {name: {int(m): v for m, v in by_m.items()}
                                       for name, by_m in record["median_ms"].items()}
                if any(k not in KERNELS for plan in record["plans"].values() for k in plan) or not record["measured_at"]:
                    raise ValueError("bad plan")
        except (OSError, json.JSONDecodeError, AttributeError, ValueError, KeyError, TypeError):
            log(f"{path}: unreadable kernel plan, measuring again")
            record = None
    if record is not None:
        record["cached"] = True
        log(f"plan of {what} from {path} (measured {record['measured_at']}; --retune measures again)")
    else:
        log(f"timing {' and '.join(KERNELS)} for {len(rows)} row counts on {what} on this machine (once per "
            f"machine, model and dtype; cached in {path})")
        median_ms = measure(model, rows, reps, cache_len, progress=True)
        load = os.getloadavg()[0]
        timed = sorted(next(iter(median_ms.values())))  # the row counts measured (EvaByte: those that fit)
        record = {"format": FORMAT, "machine": machine_info(), "model": model_info(model), "rows": timed,
                  "reps": reps, "cache_len": cache_len, "median_ms": median_ms,
                  "plans": {c: list(p) for c, p in choose(median_ms).items()}, "load": round(load, 2),
                  "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}
        if load > (os.cpu_count() or 1):
            log(f"WARNING: load average {load:.1f} above the {os.cpu_count()} cores while timing: the plan may be "
                "wrong; measure again on a quiet machine with --retune")
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(record, indent=1))
        record["cached"] = False
    for m in (model, *others):
        set_plans(m, {c: tuple(p) for c, p in record["plans"].items()})
    if adapted:
        record = {**record, "adapted": adapted}
    return record


def pack_targets(model: nn.Module, others=(), linear: str = "auto", fuse: bool = True, retune: bool = False,
                 log=None) -> dict | None:
    """Pack `model` and every other target in `others` (adapted copies of it) for decoding
    (`pack_linears`; on a CPU also `use_grouped_sdpa`) and, with `linear="auto"`, give each its
    kernel plan (`tune`). Returns tune's
    record, or None (`linear` stock or onednn, nothing packed, or a GPU). Call it once every
    adapter is attached and before building the decoder's `Target`s."""
    distinct = {id(model): model, **{id(m): m for m in others}}
    for m in distinct.values():
        pack_linears(m, linear, fuse=fuse)
        if linear != "stock":  # a CPU's masked multi-row steps on grouped KV heads (`mtpkit.models.attention`)
            use_grouped_sdpa(m)
    if linear != "auto":
        return None
    return tune(model, [m for m in distinct.values() if m is not model], retune=retune, log=log)


def plan_table(record: dict) -> str:
    """The measured table (median ms of a whole step per body/head kernel pair and row count)
    with each row count's chosen pair starred."""
    rows = record["rows"]
    plans = record["plans"]
    lines = ["| body / head kernels | " + " | ".join(f"{m} rows" for m in rows) + " |", "|---|" + "---|" * len(rows)]
    for name, by_m in record["median_ms"].items():
        chosen = [combo_name(plans["body"][m - 1], plans["head"][m - 1]) == name for m in rows]
        lines.append(f"| {name} | " + " | ".join((f"{by_m[m]:.2f}" if m in by_m else "-") + ("*" if c else "")
                                                 for m, c in zip(rows, chosen))
                     + " |")
    return "\n".join(lines)
