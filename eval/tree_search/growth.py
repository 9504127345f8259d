"""Tree growth of the tree search (`eval/tree_frontier.py`, step 3): the candidate trees of every
task, grown on its calibrations (`mtpkit.eval.tree_search.calibration`).

Per task and per mask-block placement of `--blocks` (chain = the root and the top-1 path,
quadratic decoding's blocks; leaf = the leaves only, linear decoding's): from the empty tree add
one node at a time: every child of a node (depth <= k, the next rank under its parent) is scored
by the mean accept length over the steps of the current tree's own rollout with that node added
(one-step "what-if", biased upwards), the best is kept, ties going to the smaller rank sum along
its path, then the shallower node. Every grown tree of a `--budgets` size is a candidate, and so
is the top-1 chain of every depth (quadratic / linear decoding's drafts, for reference); the
pricing then re-scores each on its own rollout (unbiased tau).
"""

from __future__ import annotations

from mtpkit.eval.tree_search.calibration import Calibration
from mtpkit.eval.tree_search.simulate import rollout
from mtpkit.models.trees import Topology


def grow(cals: list[Calibration], k: int, max_nodes: int, max_rank: int, blocks: str) -> list[Topology]:
    """Trees of 1..max_nodes nodes grown one node at a time (the module docstring)."""
    paths: list[tuple[int, ...]] = []
    grown = []
    for size in range(1, max_nodes + 1):
        # the current tree's own rollout (the empty tree: every step drafts from its block)
        if paths:
            sim = rollout(cals, [Topology(paths, blocks)], k)
            visits = list(zip(sim.anchors, sim.accepted))
        else:
            visits = [((c, j), 0) for c, cal in enumerate(cals) for j in range(cal.n - 1)]
        have = set(paths)
        candidates = []
        for parent in [()] + paths:
            if len(parent) >= k:
                continue
            r = sum(1 for p in paths if len(p) == len(parent) + 1 and p[:-1] == parent)
            if r < max_rank:
                candidates.append(parent + (r,))
        counts = dict.fromkeys(candidates, 0)
        for (c, j), L in visits:
            if L < k:
                nxt = tuple(cals[c].ranks[j, : L + 1].tolist())
                if nxt in counts and nxt not in have:
                    counts[nxt] += 1
        best = max(candidates, key=lambda p: (counts[p], -sum(p), -len(p)))
        paths.append(best)
        grown.append(Topology(list(paths), blocks, name=f"g{size}"))
    return grown


def candidate_trees(cals: dict[str, list[Calibration]], k: int, budgets: list[int], max_rank: int,
                    blocks: list[str], chains_only: bool = False) -> tuple[list[Topology], dict[str, list[int]]]:
    """(every candidate tree, each task's candidates as indices into them): the grown trees of a
    `budgets` size per task and placement (none with `chains_only`), then the top-1 chains of every
    depth 1..k per placement. A tree grown for several tasks is one candidate; names stay unique
    (`t3_4n`, and `_leaf` after a placement other than the first)."""
    trees: list[Topology] = []
    by_paths: dict[tuple, int] = {}
    suffix = {b: "" if b == blocks[0] else f"_{b}" for b in blocks}

    def add(tree: Topology, placement: str, name: str) -> int:
        key = (tuple(tree.paths), placement)
        if key not in by_paths:
            by_paths[key] = len(trees)
            trees.append(Topology(tree.paths, placement, name=name))
        return by_paths[key]

    grown_of: dict[str, list[int]] = {}
    for task, task_cals in cals.items():
        grown_of[task] = []
        for placement in blocks:
            grown = [] if chains_only else grow(task_cals, k, max(budgets), max_rank, placement)
            for t in grown:
                if t.num_nodes in budgets:
                    grown_of[task].append(add(t, placement, f"t{len(trees)}_{t.num_nodes}n{suffix[placement]}"))
    chains = []
    for placement in blocks:
        for depth in range(1, k + 1):
            chains.append(add(Topology(f"chain{depth}"), placement, f"chain{depth}{suffix[placement]}"))
    return trees, {task: list(dict.fromkeys(grown + chains)) for task, grown in grown_of.items()}

