"""Draft trees of Medusa and Hydra heads: the published default trees by name, and the trees a
drafter decodes with and the schedule over them (`choose_trees`).

A tree is a set of rank paths in Medusa's "choices" format (`mtpkit.models.trees`): the node
(r_1, ..., r_d) holds the r_d-th ranked candidate of head d under its parent. For Medusa every
node at depth d shares head d's one distribution (its candidates are head d's top tokens, whatever
the parent); for Hydra head d is run once per distinct parent at depth d - 1, on that parent's
path, so siblings at depth d + 1 get their own candidates.
"""

from __future__ import annotations

from dataclasses import replace

from mtpkit.models.schedules import Schedule, tree_schedule
from mtpkit.models.trees import Topology, TreeOptions, load_bank

MC_SIM_7B_63 = [
    [0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4], [2, 0], [0, 5], [0, 0, 1],
    [5], [0, 6], [6], [0, 7], [0, 1, 0], [1, 1], [7], [0, 8], [0, 0, 2], [3, 0], [0, 9], [8], [9], [1, 0, 0],
    [0, 2, 0], [1, 2], [0, 0, 3], [4, 0], [2, 1], [0, 0, 4], [0, 0, 5], [0, 0, 0, 0], [0, 1, 1], [0, 0, 6],
    [0, 3, 0], [5, 0], [1, 3], [0, 0, 7], [0, 0, 8], [0, 0, 9], [6, 0], [0, 4, 0], [1, 4], [7, 0], [0, 1, 2],
    [2, 0, 0], [3, 1], [2, 2], [8, 0], [0, 5, 0], [1, 5], [1, 0, 1], [0, 2, 1], [9, 0], [0, 6, 0], [0, 0, 0, 1],
    [1, 6], [0, 7, 0]]
"""Medusa's default tree (`mc_sim_7b_63` of medusa/model/medusa_choices.py in the Medusa
repository: 63 nodes, 4 deep, up to 10 candidates a head), tuned for Vicuna-7B heads. Hydra's
repository (zankner/Hydra, 3f39fbd) decodes with the same list by default: its copy in
hydra/model/hydra_choices.py is the default of `hydra_generate(hydra_choices=mc_sim_7b_63)` in
hydra/model/hydra_model.py and of `--hydra-choices` in llm_judge/gen_model_answer_hydra.py; it has
no tree of its own (`single = [[0]]` beside it). So it is also the tree EntMTP's "Hydra (default)"
and "Medusa (default)" baselines use."""

NAMED_TREES: dict[str, list[list[int]]] = {
    "mc_sim_7b_63": MC_SIM_7B_63,
    "medusa_default": MC_SIM_7B_63,
    "hydra_default": MC_SIM_7B_63,
}
"""tree=NAME of the medusa and hydra drafters (configs/trees/mc_sim_7b_63.json holds the same list,
for the other tree drafters)"""


def choose_trees(options: TreeOptions, heads: int, method: str = "medusa") -> tuple[list[Topology], Schedule]:
    """The trees `options.tree` names for K = `heads` heads and the schedule over them: '' = the
    top-1 chain of every head (chainK), a name of `NAMED_TREES`, chainN, a JSON list of rank paths
    (inline or in a .json file), each one static tree; or a bank written by eval/tree_frontier.py
    with its `schedule` for `task` (`mtpkit.models.schedules.tree_schedule`: static = its tree
    `index`, else the static tree calibrated for `task`, else its first; ladder, hyst). Refuses
    (ValueError, one line) a scheduled tree deeper than the heads and the `ema` signal (whose
    tokens' rows are the mask drafters'; the heads' banks are not calibrated on it)."""
    spec = options.tree or f"chain{heads}"
    if spec in NAMED_TREES:
        trees, schedules = [Topology([list(p) for p in NAMED_TREES[spec]], name=spec)], {}
    else:
        trees, schedules = load_bank(spec, options.task or None)
    if options.schedule != "static" and not schedules:
        raise ValueError(f"{method} tree={spec!r:.60} schedule={options.schedule}: a ladder or hyst schedule needs a "
                         "bank written by eval/tree_frontier.py --method medusa|hydra")
    schedule = tree_schedule(replace(options, tree=spec), schedules, len(trees), method)
    if schedule.switches and schedule.signal == "ema":
        raise ValueError(f"{method} tree={spec!r:.60}: signal ema is for the mask-token drafters; Medusa and Hydra "
                         "schedules read path, path_sum, entropy or accept")
    for i in schedule.trees:
        if trees[i].depth > heads:
            raise ValueError(f"tree={spec!r:.60}: tree {i} is {trees[i].depth} deep; the head has {heads} heads "
                             f"(depth <= {heads})")
    return trees, schedule


def choose_tree(spec: str, heads: int, task: str = "", index: int = -1) -> Topology:
    """The one static tree `spec` names (`choose_trees`): a bank's tree `index`, else the static
    tree calibrated for `task`, else its first."""
    trees, schedule = choose_trees(TreeOptions(tree=spec, task=task, index=index), heads)
    return trees[schedule.trees[0]]
