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

from mtpkit.eval.tree_search.calibration import Calibration
from mtpkit.eval.tree_search.pricing import tokens_per_s
from mtpkit.eval.tree_search.simulate import accept_length, path_value, rollout
from mtpkit.models.trees import Schedule, Topology


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
    None for MTPC and under sampling (greedy mask drafters only)."""
    if any(cal.cycle != "block" or cal.accept is not None for cal in cals):
        return None
    results = []
    for block in sorted({trees[i].depth for i in pool}):
        used = [i for i in pool if trees[i].depth <= block]
        options = [(trees[i], costs[f"{trees[i].name}@{block}"] + costs.get(f"draft:{trees[i].name}@{block}", 0.0))
                   for i in used]
        none, ar = costs[f"none@{block}"], costs["ar"]
        seconds, steps, tokens = len(cals) * costs["prefill"], len(cals), 0
        for cal in cals:
            n, ranks = cal.n, cal.ranks.tolist()
            # best[j][h]: (seconds, steps) to finish from anchor j (j + 1 tokens generated), h = a block drafted it
            best = [[(0.0, 0)] * 2 for _ in range(n + 1)]
            for j in range(n - 2, -1, -1):
                moves = [(none, 1, 1)] + ([(ar, 1, 0)] if ar_steps else [])
                best[j][0] = min((c + best[j + new][h][0], 1 + best[j + new][h][1]) for c, new, h in moves)
                for tree, c in options:
                    L = accept_length(tree, ranks[j])
                    has = (tree.index[tuple(ranks[j][:L])] if L else 0) in tree.block_nodes
                    moves.append((c, L + 1, int(has)))
                best[j][1] = min((c + best[min(j + new, n - 1)][h][0], 1 + best[min(j + new, n - 1)][h][1])
                                 for c, new, h in moves)
            seconds += best[0][1][0]
            steps += best[0][1][1]
            tokens += n
        results.append({"trees": used, "block": block, "ar_steps": ar_steps, "sim_tau": round(tokens / steps, 4),
                        "sim_tokens_per_s": round(tokens / seconds, 2)})
    return max(results, key=lambda r: r["sim_tokens_per_s"])


def calibrate_schedules(cals, trees, task_trees: list[int], k, costs, ratio: float, value_depth: int = 0,
                        ema_alphas: tuple[float, ...] = ()) -> dict:
    """Static, ladder and hyst schedules of one task (indices into `trees`), swept in simulation.
    The ladder's path value is `value_depth` deep (0: the deepest tree's depth); hyst's depth is
    swept from 1 to the deepest tree's with its pair and threshold unless `value_depth` fixes it.
    With `ema_alphas` (mask-token drafters) hyst's pairs are also swept on the EMA signal (the
    target's top-1 probability averaged over the generated tokens, each alpha, thresholds at the
    quantiles of that probability); hyst is the faster signal's best, and its entry's `by_signal`
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

    grids = {}

    def grid(depth: int) -> tuple[list[float], list[float]]:  # (sorted path values, 19 quantiles of them)
        if depth not in grids:
            values = sorted(path_value(cal, j, depth) for cal in cals for j in range(cal.n))
            grids[depth] = values, sorted({values[int(q * (len(values) - 1))] for q in [i / 20 for i in range(1, 20)]})
        return grids[depth]

    values, quantiles = grid(Schedule("static", value_depth=value_depth).depth_of_value(deepest))
    # small to large: nodes, then rows a step on the schedule's blocks (placements differ)
    ladder_trees = sorted(task_trees, key=lambda i: (trees[i].num_nodes, trees[i].rows(deepest)))
    if len(ladder_trees) >= 2:
        # thresholds one at a time, coordinate ascent from the quantiles
        thresholds = [values[int(len(values) * (i + 1) / len(ladder_trees))] for i in range(len(ladder_trees) - 1)]
        for i in range(len(thresholds)):
            lo = thresholds[i - 1] if i else 0.0
            hi = thresholds[i + 1] if i + 1 < len(thresholds) else 1.0
            options = [v for v in quantiles if lo <= v <= hi] or [thresholds[i]]
            thresholds[i] = max(options, key=lambda v: speed(Schedule("ladder", ladder_trees,
                                                                       thresholds[:i] + [v] + thresholds[i + 1:],
                                                                       value_depth))[0])
        out["ladder"] = Schedule("ladder", ladder_trees, thresholds, value_depth)
        # (below tau_on, above it): the small tree first, then the other order
        pairs = [(a, b) for x, a in enumerate(ladder_trees) for b in ladder_trees[x + 1:]]
        pairs += [(b, a) for a, b in pairs]
        depths = [value_depth] if value_depth else [d if d < deepest else 0 for d in range(deepest, 0, -1)]
        # the sweep's two ends too: always the second tree (0) and never (NEVER: above every path
        # value, a product of probabilities), so a switch that pays nowhere leaves the first tree
        # alone; the ends read no path value, so they are tried on the first depth only
        candidates = []
        for x, d in enumerate(depths):
            sweep = [0.0, *grid(d or deepest)[1], NEVER] if x == 0 else grid(d)[1]
            candidates += [Schedule("hyst", [a, b], [ratio * v, v], d) for a, b in pairs for v in sweep]
        # last, the static tree itself: a pair's trees share the deeper one's blocks, so where the
        # static tree is shallower than every pair it is in, no pair reaches it
        candidates.append(Schedule("hyst", [static, static], [ratio * NEVER, NEVER]))
        by_signal = {"path": max(candidates, key=lambda s: speed(s)[0])}  # equals: the default depth, the small tree below
        if ema_alphas and all(cal.cycle == "block" for cal in cals):
            top1 = sorted(p for cal in cals for p in cal.target_top1.tolist())
            sweep = sorted({top1[int(q * (len(top1) - 1))] for q in [i / 20 for i in range(1, 20)]})
            by_signal["ema"] = max((Schedule("hyst", [a, b], [ratio * v, v], signal="ema", alpha=alpha)
                                    for a, b in pairs for alpha in ema_alphas for v in sweep), key=lambda s: speed(s)[0])
        out["hyst"] = max(by_signal.values(), key=lambda s: speed(s)[0])  # equals: the path value
    result = {name: entry(schedule) for name, schedule in out.items()}
    if "hyst" in out and len(by_signal) > 1:
        result["hyst"]["by_signal"] = {signal: entry(schedule) for signal, schedule in by_signal.items()}
    return result


def build_bank(cals: dict[str, list[Calibration]], trees: list[Topology], candidates: dict[str, list[int]], k: int,
               costs: dict, masks: bool, pool_speed: float, pool_size: int, hyst_ratio: float, value_depth: int,
               ema_alphas: tuple[float, ...]) -> tuple[list[Topology], dict]:
    """(the bank, the report of every task) from the `candidates` of each task (indices into
    `trees`): each candidate's simulated tau and tokens/s, the task's throughput frontier and
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
                         "sim_tokens_per_s": round(tokens_per_s(sim, task_cals, costs, trees), 2)})
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
        t["schedules"] = calibrate_schedules(task_cals, bank, pool, k, costs, hyst_ratio, value_depth, ema_alphas)
        bounds = [oracle(task_cals, bank, pool, costs, ar_steps) for ar_steps in (False, True)]
        if bounds[0] is not None:
            t["oracle"], t["oracle_ar"] = bounds
        for row in t["trees"]:
            row["bank"] = renumber.get(row.pop("tree"))
        t["frontier"] = [renumber[i] for i in t["frontier"]]
        t["pool"] = pool
    return bank, tasks

