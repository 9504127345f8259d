"""The future-known bound of a bank over Medusa and Hydra heads (`schedules.oracle`, cycle "heads"):
the best any schedule of the pool could do, by dynamic programming. Checked against brute force
over every sequence of trees on short calibrations, and against the simulated schedules."""

from __future__ import annotations

import itertools

import torch

from mtpkit.eval.tree_search.calibration import Calibration
from mtpkit.eval.tree_search.pricing import tokens_per_s
from mtpkit.eval.tree_search.schedules import oracle
from mtpkit.eval.tree_search.simulate import accept_length, rollout
from mtpkit.models.schedules import Schedule
from mtpkit.models.trees import Topology

K = 3


def _trees() -> list[Topology]:
    return [Topology([(0,)], name="chain1"), Topology([(0,), (1,)], name="top2"),
            Topology([(0,), (0, 0), (0, 0, 0)], name="chain3")]


def _costs(trees) -> dict:
    costs = {"prefill": 0.4, "ar": 0.05}
    for i, t in enumerate(trees):
        costs[f"{t.name}@0"] = 0.05 + 0.012 * t.num_nodes
        costs[f"draft:{t.name}@0"] = 0.004 * (i + 1)
    return costs


def _cals(n: int, prompts: int, seed: int) -> list[Calibration]:
    g = torch.Generator().manual_seed(seed)
    cals = []
    for p in range(prompts):
        ranks = torch.randint(0, 3, (n, K), generator=g)  # rank 0 often: drafts are accepted
        cals.append(Calibration("t", 5, n, ranks, torch.rand(n, generator=g), torch.rand(n, K, generator=g),
                                cycle="heads"))
    return cals


def _brute(cal: Calibration, trees, pool, costs, ar_steps: bool) -> tuple[float, int]:
    """(seconds, steps) of the fastest sequence of choices, by trying every one."""
    ranks = cal.ranks.tolist()
    moves = [(costs[f"{trees[i].name}@0"] + costs[f"draft:{trees[i].name}@0"], trees[i]) for i in pool]
    moves += [(costs["ar"], None)] if ar_steps else []
    best = None
    for seq in itertools.product(range(len(moves)), repeat=cal.n):
        seconds, steps, gen, j = costs["prefill"], 1, 1, 0
        for m in seq:
            if gen >= cal.n:
                break
            c, tree = moves[m]
            new = 1 if tree is None else accept_length(tree, ranks[j]) + 1
            seconds, steps, gen, j = seconds + c, steps + 1, gen + new, j + new
        best = min(best or (seconds, steps), (seconds, steps))
    return best


def test_heads_oracle_equals_brute_force_and_bounds_every_schedule():
    trees, pool = _trees(), [0, 1, 2]
    costs = _costs(trees)
    for seed in range(3):
        cals = _cals(n=7, prompts=2, seed=seed)
        for ar_steps in (False, True):
            got = oracle(cals, trees, pool, costs, ar_steps)
            brute = [_brute(c, trees, pool, costs, ar_steps) for c in cals]
            tokens = sum(c.n for c in cals)
            assert got["sim_tokens_per_s"] == round(tokens / sum(s for s, _ in brute), 2)
            assert got["block"] == 0 and got["ar_steps"] == ar_steps
    # the bound holds over every static tree and a spread of ladders on longer calibrations
    cals = _cals(n=40, prompts=4, seed=7)
    bound = oracle(cals, trees, pool, costs)["sim_tokens_per_s"]
    schedules = [Schedule("static", [i]) for i in pool]
    schedules += [Schedule("ladder", pool, [a, b]) for a, b in ((0.1, 0.5), (0.3, 0.9), (0.01, 0.02))]
    speeds = [tokens_per_s(rollout(cals, trees, K, s), cals, costs, trees) for s in schedules]
    assert bound >= max(speeds) - 0.01
    assert bound > min(speeds)  # the choices matter here: a bound equal to every schedule shows nothing
