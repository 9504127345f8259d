"""The bank and its schedules (`eval/tree_frontier.py`, step 4): per task the throughput frontier
of the candidate trees, the pool of the schedules, the bank of every task's trees, the calibrated
static / ladder / hyst schedules (after "EntMTP: Accelerating LLM Inference with Entropy Guided
Multi Token Prediction", Chen) and the future-known bound.

Per task the throughput frontier (more nodes only if more tokens/s) and the tau frontier (more
nodes only if a higher tau) within --pool-speed of the fastest tree form the pool of the
schedules, and the bank holds every task's pool: static (the fastest tree), ladder (the pool,
small to large, thresholds swept), hyst (two trees of the pool, one below tau_on and one above
it, every pair in both orders: the paper's conservative tree below and aggressive tree above,
and the other way round, where a bigger step pays on the doubtful steps; tau_on swept from 0,
always the second tree, to above every path value, never: a switch that pays on no threshold
leaves hyst on its first tree; tau_off = --hyst-ratio x tau_on; the path value's depth swept too
unless --value-depth fixes it; for a mask-token drafter every pair is also swept on the EMA of
the target's top-1 probability over the generated tokens, `--ema-alphas`, and the faster signal
kept).

Greedy mask drafters also get the future-known bound (`oracle`): the fastest any schedule over
the pool could be, each step's tree chosen knowing every tree's accept length there, and the
same with plain AR steps allowed; how far the schedules are from it says how much a better
run-time signal could still gain.
"""

from __future__ import annotations

import json
import math

from mtpkit.eval.tree_search.calibration import Calibration
from mtpkit.eval.tree_search.growth import self_tau
from mtpkit.eval.tree_search.pricing import tokens_per_s
from mtpkit.eval.tree_search.simulate import accept_length, path_value, rollout
from mtpkit.models.schedules import SMOOTHED, Schedule
from mtpkit.models.trees import Topology


def frontier(trees: list[Topology], values: list[float]) -> list[int]:
    """Indices of the non-dominated trees: sorted by nodes (the better first among trees of as many
    nodes), each kept only if its value (tokens/s, or tau) is above every smaller tree's kept before it."""
    order = sorted(range(len(trees)), key=lambda i: (trees[i].num_nodes, -values[i]))  # a tie: the best first
    kept, best = [], 0.0
    for i in order:
        if values[i] > best:
            kept.append(i)
            best = values[i]
    return kept


def schedule_pool(trees: list[Topology], speeds: list[float], taus: list[float], pool_speed: float,
                  pool_size: int) -> tuple[list[int], list[int]]:
    """(the throughput frontier, the schedules' pool) of one task's candidate `trees`, as indices.
    The pool: the throughput frontier, and the trees of the tau frontier (more nodes only for a
    higher tau) within `pool_speed` of the fastest tree's tokens/s (a tree slower on average may
    still pay on the confident steps a schedule gives it); at most `pool_size` of them, the
    fastest, so the best static tree is always among them; ordered by nodes."""
    kept = frontier(trees, speeds)
    pool = list(kept)
    for i in frontier(trees, taus):
        if speeds[i] >= pool_speed * max(speeds) and i not in pool:
            pool.append(i)
    pool = sorted(pool, key=lambda i: -speeds[i])[:pool_size]
    return kept, sorted(pool, key=lambda i: trees[i].num_nodes)


NEVER = 2.0
"""a hyst tau_on above every path value (a product of probabilities): the schedule never switches on"""


def oracle(cals: list[Calibration], trees: list[Topology], pool: list[int], costs: dict,
           ar_steps: bool = False) -> dict | None:
    """The best any schedule over `pool` could do on `cals`: every step's choice made knowing the
    future (the accept length of every tree at every anchor), by dynamic programming over (anchor,
    whether a mask block drafted it) on the simulator's steps and `costs`. A step may use a pool
    tree, ignore its draft (the root's block alone), or with `ar_steps` be a plain AR step (no
    draft and no block: the next step drafts nothing). A schedule's deepest tree sets its block,
    so the bound is the best over blocks D of the pool's trees at most D deep on D-mask blocks.
    An upper bound of every schedule's simulated tokens/s, not a policy (it reads the future).
    Medusa and Hydra heads (cycle "heads": every step's deepest accepted node drafts the next
    tree, no blocks): `heads_oracle`. None for MTPC and under sampling."""
    if any(cal.accept is not None for cal in cals):
        return None
    if all(cal.cycle == "heads" for cal in cals):
        return heads_oracle(cals, trees, pool, costs, ar_steps)
    if any(cal.cycle != "block" for cal in cals):
        return None
    results = []
    for block in sorted({trees[i].depth for i in pool}):
        used = [i for i in pool if trees[i].depth <= block]
        options = [(trees[i], costs[f"{trees[i].name}@{block}"] + costs.get(f"draft:{trees[i].name}@{block}", 0.0))
                   for i in used]
        none, ar = costs[f"none@{block}"], costs["ar"]

        def moves(ranks: list, drafted: int) -> list[tuple[float, int, int]]:
            # from an anchor with (1) or without (0) a block: the root's block alone, an AR step,
            # or (with a block) a pool tree, whose deepest accepted node may carry a block
            out = [(none, 1, 1)] + ([(ar, 1, 0)] if ar_steps else [])
            for tree, c in options if drafted else ():
                L = accept_length(tree, ranks)
                out.append((c, L + 1, int((tree.index[tuple(ranks[:L])] if L else 0) in tree.block_nodes)))
            return out

        results.append({"trees": used, "block": block, "ar_steps": ar_steps,
                        **future_known(cals, costs, moves, states=2, start=1)})
    return max(results, key=lambda r: r["sim_tokens_per_s"])


def heads_oracle(cals: list[Calibration], trees: list[Topology], pool: list[int], costs: dict,
                 ar_steps: bool = False) -> dict:
    """`oracle` for Medusa and Hydra heads: each step drafts one pool tree (with `ar_steps` it may
    also be a plain AR step: no nodes, one token), chosen knowing the accept length of every tree
    at every anchor; dynamic programming over anchors on the simulator's steps and `costs`."""
    options = [(trees[i], costs[f"{trees[i].name}@0"] + costs.get(f"draft:{trees[i].name}@0", 0.0)) for i in pool]

    def moves(ranks: list, _state: int) -> list[tuple[float, int, int]]:
        return [(c, accept_length(tree, ranks) + 1, 0) for tree, c in options] + ([(costs["ar"], 1, 0)] if ar_steps else [])

    return {"trees": list(pool), "block": 0, "ar_steps": ar_steps, **future_known(cals, costs, moves, states=1, start=0)}


def future_known(cals: list[Calibration], costs: dict, moves, states: int, start: int) -> dict:
    """The dynamic program of the oracles: per calibration, best[j][h] = the least (seconds, steps)
    to finish from anchor j (j + 1 tokens generated) in state h, over `moves(ranks at j, h)` ->
    [(seconds, tokens gained, next state)]; each reply starts in state `start` after its prefill.
    Returns the whole run's sim_tau and sim_tokens_per_s."""
    seconds, steps, tokens = len(cals) * costs["prefill"], len(cals), 0
    for cal in cals:
        n, ranks = cal.n, cal.ranks.tolist()
        best = [[(0.0, 0)] * states for _ in range(n)]
        for j in range(n - 2, -1, -1):
            for h in range(states):
                best[j][h] = min((c + best[min(j + new, n - 1)][to][0], 1 + best[min(j + new, n - 1)][to][1])
                                 for c, new, to in moves(ranks[j], h))
        seconds += best[0][start][0]
        steps += best[0][start][1]
        tokens += n
    return {"sim_tau": round(tokens / steps, 4), "sim_tokens_per_s": round(tokens / seconds, 2)}


def swept_signals(cals: list[Calibration], signals: tuple[str, ...], ema_alphas: tuple[float, ...]) -> list[str]:
    """The signals of `signals` these calibrations replay (`simulate.check_signal`), path first; the
    smoothed ones only with `ema_alphas` (their weights)."""
    cycles = {cal.cycle for cal in cals}
    out = []
    for signal in ["path"] + [s for s in signals if s != "path"]:
        if signal in SMOOTHED and not ema_alphas:
            continue
        if signal == "ema" and cycles != {"block"}:
            continue
        if signal in ("entropy", "accept") and ("alg2" in cycles or (
                signal == "entropy" and any(cal.target_entropy is None for cal in cals))):
            continue
        out.append(signal)
    return list(dict.fromkeys(out))


def calibrate_schedules(cals, trees, task_trees: list[int], k, costs, ratio: float, value_depth: int = 0,
                        ema_alphas: tuple[float, ...] = (), signals: tuple[str, ...] = ("path", "ema")) -> dict:
    """Static, ladder and hyst schedules of one task (indices into `trees`), swept in simulation
    on each signal of `signals` these calibrations replay (`swept_signals`; `mtpkit.models.trees`):
    path (the path value), path_sum (the path values summed over depths), and with `ema_alphas`
    the smoothed entropy, accept and ema (mask-token drafters), each alpha of `ema_alphas`. The
    path values are `value_depth` deep (0: the ladder as deep as the deepest tree; hyst's depth
    swept from 1 to that with its pair and threshold); thresholds are swept over quantiles of each
    signal's values (accept: a grid over 1 .. the deepest tree's depth + 1). Ladder and hyst are
    each the fastest signal's best, and with more than one signal their entry's `by_signal`
    holds each signal's best.
    Hyst pairs every two pool trees in both orders: the first is used below tau_on, the second
    above it, so the sweep also finds a pair whose bigger step pays on the doubtful steps (the
    chain-block tree's extra root block proposes again after a rejection). Where no pair is faster
    than the static tree, hyst is the static tree (trees (s, s)): never slower in simulation."""
    simulated = {}  # a schedule is simulated once: the sweep's winners are read again below

    def speed(schedule):
        key = json.dumps(schedule.to_json())
        if key not in simulated:
            sim = rollout(cals, trees, k, schedule)
            simulated[key] = tokens_per_s(sim, cals, costs, trees), sim.tau
        return simulated[key]

    def entry(schedule) -> dict:
        s, tau = speed(schedule)
        return {**schedule.to_json(), "sim_tau": round(tau, 4), "sim_tokens_per_s": round(s, 2)}

    static = max(task_trees, key=lambda i: speed(Schedule("static", [i]))[0])
    out = {"static": Schedule("static", [static])}
    deepest = max(trees[i].depth for i in task_trees)
    swept = swept_signals(cals, signals, ema_alphas)

    grids = {}

    def grid(signal: str, depth: int = 0) -> tuple[list[float], list[float]]:  # (sorted values, 19 quantiles)
        if (signal, depth) not in grids:
            if signal in ("path", "path_sum"):
                values = [path_value(cal, j, depth, signal=signal) for cal in cals for j in range(cal.n)]
            elif signal == "ema":
                values = [p for cal in cals for p in cal.target_top1.tolist()]
            elif signal == "entropy":
                values = [math.exp(-h) for cal in cals for h in cal.target_entropy.tolist()]
            else:  # accept: tokens a drafted step adds, 1 .. deepest + 1
                values = [1.0 + deepest * i / 20 for i in range(1, 20)]
            values = sorted(values)
            grids[signal, depth] = values, sorted({values[int(q * (len(values) - 1))]
                                                   for q in [i / 20 for i in range(1, 20)]})
        return grids[signal, depth]

    def variants(signal: str, depths: list[int]) -> list[dict]:  # Schedule keywords of each depth or alpha
        if signal in SMOOTHED:
            return [{"signal": signal, "alpha": alpha} for alpha in ema_alphas]
        return [{"value_depth": d, "signal": signal} for d in depths]

    def sweep_of(options: dict) -> list[float]:
        if options["signal"] in ("path", "path_sum"):
            return grid(options["signal"], options["value_depth"] or deepest)[1]
        return grid(options["signal"])[1]

    # small to large: nodes, then rows a step on the schedule's blocks (placements differ)
    ladder_trees = sorted(task_trees, key=lambda i: (trees[i].num_nodes, trees[i].rows(deepest)))
    ladders, hysts = {}, {}
    if len(ladder_trees) >= 2:
        for signal in swept:  # ladders: thresholds one at a time, coordinate ascent from the quantiles
            best = None
            for options in variants(signal, [value_depth]):
                values, quantiles = (grid(signal, options["value_depth"] or deepest) if "value_depth" in options
                                     else grid(signal))
                thresholds = [values[int(len(values) * (i + 1) / len(ladder_trees))]
                              for i in range(len(ladder_trees) - 1)]
                for i in range(len(thresholds)):
                    lo = thresholds[i - 1] if i else -math.inf
                    hi = thresholds[i + 1] if i + 1 < len(thresholds) else math.inf
                    choices = [v for v in quantiles if lo <= v <= hi] or [thresholds[i]]
                    thresholds[i] = max(choices, key=lambda v: speed(Schedule(
                        "ladder", ladder_trees, thresholds[:i] + [v] + thresholds[i + 1:], **options))[0])
                ladder = Schedule("ladder", ladder_trees, thresholds, **options)
                if best is None or speed(ladder)[0] > speed(best)[0]:
                    best = ladder
            ladders[signal] = best
        # (below tau_on, above it): the small tree first, then the other order
        pairs = [(a, b) for x, a in enumerate(ladder_trees) for b in ladder_trees[x + 1:]]
        pairs += [(b, a) for a, b in pairs]
        depths = [value_depth] if value_depth else [d if d < deepest else 0 for d in range(deepest, 0, -1)]
        for signal in swept:
            candidates = []
            for x, options in enumerate(variants(signal, depths)):
                sweep = sweep_of(options)
                if signal == "path" and x == 0:
                    # the sweep's two ends too: always the second tree (0) and never (NEVER: above
                    # every path value, a product of probabilities), so a switch that pays nowhere
                    # leaves the first tree alone; the ends read no path value, so they are tried
                    # on the first depth only
                    sweep = [0.0, *sweep, NEVER]
                candidates += [Schedule("hyst", [a, b], [ratio * v, v], **options) for a, b in pairs for v in sweep]
            if signal == "path":
                # last, the static tree itself: a pair's trees share the deeper one's blocks, so where the
                # static tree is shallower than every pair it is in, no pair reaches it
                candidates.append(Schedule("hyst", [static, static], [ratio * NEVER, NEVER]))
            hysts[signal] = max(candidates, key=lambda s: speed(s)[0])  # equals: the default depth, the small tree below
        # equals: the path value
        out["ladder"] = max(ladders.values(), key=lambda s: speed(s)[0])
        out["hyst"] = max(hysts.values(), key=lambda s: speed(s)[0])
    result = {name: entry(schedule) for name, schedule in out.items()}
    for name, by_signal in (("ladder", ladders), ("hyst", hysts)):
        if name in out and len(by_signal) > 1:
            result[name]["by_signal"] = {signal: entry(schedule) for signal, schedule in by_signal.items()}
    return result


def build_bank(cals: dict[str, list[Calibration]], trees: list[Topology], candidates: dict[str, list[int]], k: int,
               costs: dict, masks: bool, pool_speed: float, pool_size: int, hyst_ratio: float, value_depth: int,
               ema_alphas: tuple[float, ...], signals: tuple[str, ...] = ("path", "ema"),
               biased: dict[str, dict[int, float]] | None = None) -> tuple[list[Topology], dict]:
    """(the bank, the report of every task) from the `candidates` of each task (indices into
    `trees`): each candidate's simulated tau and tokens/s, its mean accept length on its own
    rollout (`self_tau`) and, where growth scored it (`biased`: per task, by index), its one-step
    estimate (`biased_tau`: EntMTP's Appendix B pair), the task's throughput frontier and
    schedules' pool (`schedule_pool`); the bank is every task's pool and frontier, ordered by
    nodes; then each task's schedules over its pool (`calibrate_schedules`) and the future-known
    bounds (`oracle`, without and with plain AR steps). `masks`: whether steps carry mask blocks
    (False: MTPC)."""
    tasks, pools, in_bank = {}, {}, set()
    for task, task_cals in cals.items():
        rows = []
        for i in candidates[task]:
            sim = rollout(task_cals, trees, k, Schedule("static", [i]))
            rows.append({"tree": i, "name": trees[i].name, "nodes": trees[i].num_nodes,
                         "rows": trees[i].rows(trees[i].depth if masks else 0), "depth": trees[i].depth,
                         "sim_tau": round(sim.tau, 4),
                         "sim_tokens_per_s": round(tokens_per_s(sim, task_cals, costs, trees), 2),
                         "self_tau": round(self_tau(sim.accepted), 4)})
            if biased and i in biased.get(task, {}):
                rows[-1]["biased_tau"] = round(biased[task][i], 4)
        ar_speed = sum(c.n for c in task_cals) / (len(task_cals) * costs["prefill"]
                                                 + sum(c.n - 1 for c in task_cals) * costs["ar"])
        kept, pool = schedule_pool([trees[i] for i in candidates[task]], [r["sim_tokens_per_s"] for r in rows],
                                   [r["sim_tau"] for r in rows], pool_speed, pool_size)
        kept, pools[task] = [candidates[task][i] for i in kept], [candidates[task][i] for i in pool]
        in_bank.update(pools[task] + kept)  # the whole throughput frontier, even where the pool is capped
        tasks[task] = {"prompts": len(task_cals), "sim_ar_tokens_per_s": round(ar_speed, 2), "trees": rows,
                       "frontier": kept}
    order = sorted(in_bank, key=lambda i: (trees[i].num_nodes, i))  # the bank, renumbered
    renumber = {old: new for new, old in enumerate(order)}
    bank = [trees[i] for i in order]
    for task, task_cals in cals.items():
        pool = [renumber[i] for i in pools[task]]
        t = tasks[task]
        t["schedules"] = calibrate_schedules(task_cals, bank, pool, k, costs, hyst_ratio, value_depth, ema_alphas,
                                             signals)
        bounds = [oracle(task_cals, bank, pool, costs, ar_steps) for ar_steps in (False, True)]
        if bounds[0] is not None:
            t["oracle"], t["oracle_ar"] = bounds
        for row in t["trees"]:
            row["bank"] = renumber.get(row.pop("tree"))
        t["frontier"] = [renumber[i] for i in t["frontier"]]
        t["pool"] = pool
    return bank, tasks

