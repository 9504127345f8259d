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

The one-step score is EntMTP's biased estimate ("EntMTP: Accelerating LLM Inference with Entropy
Guided Multi Token Prediction", Chen, arXiv:2606.27550, Sec. 3.1.1 and Appendix B): the candidate
T + v is scored on the trajectory of T, whose proposals it would not have made on its own.
`biased_tau` is that estimate for every candidate, as a mean accept length (1 + the mean accepted
drafts per drafted step of T's rollout, under T + v); the bank's report puts it beside the same
mean on the tree's own rollout (`self_tau`, the paper's self-rollout recalibration).
"""

from __future__ import annotations

from mtpkit.eval.tree_search.calibration import Calibration
from mtpkit.eval.tree_search.simulate import accept_length, rollout
from mtpkit.models.trees import Topology


def biased_tau(cals: list[Calibration], tree: Topology, parent: list[tuple[int, ...]], k: int) -> float:
    """`tree`'s one-step ("what-if") mean accept length on the trajectory of `parent` (a subtree:
    its rank paths, the tree less the node growth added last): 1 + the mean over the parent's
    drafted steps of the drafts `tree` would have accepted there (the empty parent: every anchor
    but the last). Biased upwards against `tree`'s own rollout (the module docstring)."""
    if parent:
        sim = rollout(cals, [Topology(parent, tree.blocks)], k)
        anchors = sim.anchors
    else:
        anchors = [(c, j) for c, cal in enumerate(cals) for j in range(cal.n - 1)]
    ranks = [cal.ranks.tolist() for cal in cals]
    return 1.0 + sum(accept_length(tree, ranks[c][j]) for c, j in anchors) / max(len(anchors), 1)


def self_tau(accepted: list[int]) -> float:
    """A tree's mean accept length on its own rollout: 1 + the mean accepted drafts per drafted
    step (`Rollout.accepted`), the same footing as `biased_tau`."""
    return 1.0 + sum(accepted) / max(len(accepted), 1)


def grow(cals: list[Calibration], k: int, max_nodes: int, max_rank: int, blocks: str
         ) -> tuple[list[Topology], list[float]]:
    """(trees of 1..max_nodes nodes grown one node at a time, each one's one-step score as a mean
    accept length, `biased_tau`) (the module docstring)."""
    paths: list[tuple[int, ...]] = []
    grown, scores = [], []
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
        # the new node is a leaf: a visit accepts one more draft iff its next rank path is that node
        scores.append(1.0 + (sum(L for _, L in visits) + counts[best]) / max(len(visits), 1))
        paths.append(best)
        grown.append(Topology(list(paths), blocks, name=f"g{size}"))
    return grown, scores


def candidate_trees(cals: dict[str, list[Calibration]], k: int, budgets: list[int], max_rank: int,
                    blocks: list[str], chains_only: bool = False
                    ) -> tuple[list[Topology], dict[str, list[int]], dict[str, dict[int, float]]]:
    """(every candidate tree, each task's candidates as indices into them, each task's one-step
    scores `biased_tau` of its candidates by index): the grown trees of a `budgets` size per task
    and placement (none with `chains_only`), then the top-1 chains of every depth 1..k per
    placement (a chain's score: on the trajectory of the chain one shorter). A tree grown for
    several tasks is one candidate; names stay unique (`t3_4n`, and `_leaf` after a placement
    other than the first)."""
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
    biased: dict[str, dict[int, float]] = {}
    for task, task_cals in cals.items():
        grown_of[task], biased[task] = [], {}
        for placement in blocks:
            grown, scores = ([], []) if chains_only else grow(task_cals, k, max(budgets), max_rank, placement)
            for t, score in zip(grown, scores):
                if t.num_nodes in budgets:
                    i = add(t, placement, f"t{len(trees)}_{t.num_nodes}n{suffix[placement]}")
                    grown_of[task].append(i)
                    biased[task].setdefault(i, score)
    chains = []
    for placement in blocks:
        for depth in range(1, k + 1):
            chains.append(add(Topology(f"chain{depth}"), placement, f"chain{depth}{suffix[placement]}"))
    for task, task_cals in cals.items():
        if any(cal.accept is not None for cal in task_cals):
            continue  # MTPC under sampling: acceptances are drawn, not ranked; no one-step score
        for i in chains:
            if i not in biased[task]:
                t = trees[i]
                biased[task][i] = biased_tau(task_cals, t, t.paths[:-1], k)
    return trees, {task: list(dict.fromkeys(grown + chains)) for task, grown in grown_of.items()}, biased
