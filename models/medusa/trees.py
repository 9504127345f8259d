"""Draft trees of Medusa and Hydra heads: the published default trees by name, and the one
topology a drafter decodes with (`choose_tree`).

A tree is a set of rank paths in Medusa's "choices" format (`mtpkit.models.trees`): the node
(r_1, ..., r_d) holds the r_d-th ranked candidate of head d under its parent. For Medusa every
node at depth d shares head d's one distribution (its candidates are head d's top tokens, whatever
the parent); for Hydra head d is run once per distinct parent at depth d - 1, on that parent's
path, so siblings at depth d + 1 get their own candidates.
"""

from __future__ import annotations

from mtpkit.models.trees import Topology, load_bank

MC_SIM_7B_63 = [
    [0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4], [2, 0], [0, 5], [0, 0, 1],
    [5], [0, 6], [6], [0, 7], [0, 1, 0], [1, 1], [7], [0, 8], [0, 0, 2], [3, 0], [0, 9], [8], [9], [1, 0, 0],
    [0, 2, 0], [1, 2], [0, 0, 3], [4, 0], [2, 1], [0, 0, 4], [0, 0, 5], [0, 0, 0, 0], [0, 1, 1], [0, 0, 6],
    [0, 3, 0], [5, 0], [1, 3], [0, 0, 7], [0, 0, 8], [0, 0, 9], [6, 0], [0, 4, 0], [1, 4], [7, 0], [0, 1, 2],
    [2, 0, 0], [3, 1], [2, 2], [8, 0], [0, 5, 0], [1, 5], [1, 0, 1], [0, 2, 1], [9, 0], [0, 6, 0], [0, 0, 0, 1],
    [1, 6], [0, 7, 0]]
"""Medusa's default tree (`mc_sim_7b_63` of medusa/model/medusa_choices.py in the Medusa
repository: 63 nodes, 4 deep, up to 10 candidates a head), tuned for Vicuna-7B heads. Hydra's
repository decodes with the same list by default (hydra/model/hydra_choices.py), so it is also
the tree EntMTP's "Hydra (default)" and "Medusa (default)" baselines use."""

NAMED_TREES: dict[str, list[list[int]]] = {
    "mc_sim_7b_63": MC_SIM_7B_63,
    "medusa_default": MC_SIM_7B_63,
    "hydra_default": MC_SIM_7B_63,
}
"""tree=NAME of the medusa and hydra drafters (configs/trees/mc_sim_7b_63.json holds the same list,
for the other tree drafters)"""


def choose_tree(spec: str, heads: int, task: str = "", index: int = -1) -> Topology:
    """The topology `spec` names for K = `heads` heads: '' = the top-1 chain of every head
    (chainK), a name of `NAMED_TREES`, chainN, a JSON list of rank paths (inline or in a .json
    file), or a bank written by eval/tree_frontier.py (its tree `index`, else the static tree
    calibrated for `task`, else its first). Refuses (ValueError, one line) a tree deeper than the
    heads."""
    if not spec:
        spec = f"chain{heads}"
    if spec in NAMED_TREES:
        topology = Topology([list(p) for p in NAMED_TREES[spec]], name=spec)
    else:
        trees, schedules = load_bank(spec, task or None)
        if index < 0:
            index = schedules.get("static", {}).get("trees", [0])[0]
        if not isinstance(index, int) or not 0 <= index < len(trees):
            raise ValueError(f"tree={spec!r:.60}: index {index!r}, the bank has {len(trees)} tree(s)")
        topology = trees[index]
    if topology.depth > heads:
        raise ValueError(f"tree={spec!r:.60} is {topology.depth} deep; the head has {heads} heads (depth <= {heads})")
    return topology
