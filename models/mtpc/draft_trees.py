"""Draft trees from a circuit head: the rank-path trees the MTPC drafter proposes, and the path
values its tree schedules switch on ("Fast and Expressive Multi-Byte Prediction with
Probabilistic Circuits", arXiv:2511.11346; trees as in `mtpkit.models.trees`).

Node (r_1..r_d) sits under node (r_1..r_{d-1}) and holds, for greedy decoding, the r_d-th most
probable byte of the circuit's exact conditional q(x_d | the kept bytes, the parent path's bytes)
(`next_log_probs_posterior`, one batched query per depth over that depth's parents; the rank-0
path is `circuits.greedy_chain`); under speculative sampling, the r_d-th draw WITHOUT replacement
from that conditional (Gumbel top-k), verified with q with the earlier draws' bytes zeroed and
renormalised, the distribution it was drawn from. The verifier's recursive rejection (accept x
with min(1, p / q), else p <- norm(max(p - q, 0)) and the next sibling) is then exact: Jeon et
al., "Recursive Speculative Decoding: Accelerating LLM Inference via Sampling Without
Replacement" (arXiv:2402.14160). Merging i.i.d. windows into a trie and deduplicating siblings
would NOT be: a dropped duplicate's rejection would have moved p by its residual update, and that
update is lost. A rank with no lower-ranked sibling in the tree (paths [[1]]) is still the r-th
draw, verified with q less the earlier draws (exact: they are the drafter's own randomness).

Tree schedules (`tree=bank.json,schedule=ladder|hyst,task=T`, a bank written by
`eval/tree_frontier.py --method mtpc`) pick a tree of the bank before each draft by the path
value: the target's top-1 probability at the newest byte with a state times the circuit's top-1
conditional probabilities along its own top-1 chain (`chain_value`), as deep as the deepest
scheduled tree or the schedule's `value_depth` (`signal: path_sum`: the chain's products summed
over its depths, `mtpkit.models.schedules.path_signal`). Each depth is a sequential query; the
first is the one the tree's depth 1 needs anyway, so `value_depth` 1 costs no query.
"""

from __future__ import annotations

import torch

from mtpkit.models.mtpc.circuits import next_log_probs_posterior
from mtpkit.models.schedules import Schedule, tree_schedule
from mtpkit.models.trees import Topology, TreeOptions, load_bank


def load_trees(options: TreeOptions) -> tuple[list[Topology], Schedule]:
    """The draft trees `options.tree` names (read by `mtpkit.models.trees.load_bank`) and the
    schedule over them (`options.schedule`, `task`, `index`); a ValueError naming `tree` otherwise."""
    try:
        trees, schedules = load_bank(options.tree.strip(), options.task or None)
    except (ValueError, TypeError) as e:  # a JSONDecodeError is a ValueError; a path not a list: TypeError
        raise ValueError(f"mtpc tree={options.tree!r}: {e}") from None
    schedule = tree_schedule(options, schedules, len(trees), f"mtpc tree={options.tree!r}")
    if schedule.signal not in ("path", "path_sum"):
        raise ValueError(f"mtpc tree={options.tree!r} schedule={options.schedule}: signal {schedule.signal!r}; "
                         "MTPC schedules read the path values (signal 'path' or 'path_sum')")
    for i in schedule.trees:
        if not trees[i].num_nodes:
            raise ValueError(f"mtpc tree={options.tree!r}: tree {i} is empty")
    return trees, schedule


def load_tree(spec: str, index: int = 0) -> Topology:
    """Tree `index` of the bank (or the one tree) `spec` names (`load_trees`)."""
    trees, schedule = load_trees(TreeOptions(tree=spec, index=index))
    return trees[schedule.trees[0]]


def tree_levels(tree: Topology, device=None) -> list[tuple]:
    """Per depth 1..D: (its nodes, their distinct parents, each node's index into those parents,
    each node's rank) as LongTensors on `device`, and 1 + its largest rank (node 0 = the root,
    j = tree.paths[j - 1])."""
    levels = []
    for nodes, parents in tree.levels():
        index = [parents.index(tree.parents[j - 1]) for j in nodes]
        ranks = [tree.ranks[j - 1] for j in nodes]
        levels.append((*(torch.tensor(x, device=device) for x in (nodes, parents, index, ranks)), 1 + max(ranks)))
    return levels


def sibling_probs(q: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """[P, k, V]: row j of parent p is q[p] [V] with the bytes of its draws order[p, :j] zeroed and
    renormalised, the distribution its j-th draw without replacement comes from (all zero once
    q's support is used up: such a node is never accepted and leaves p as it is)."""
    earlier = torch.zeros(*order.shape, q.shape[-1], dtype=q.dtype, device=q.device)
    earlier.scatter_(2, order[:, :, None], 1.0)
    earlier = earlier.cumsum(1) - earlier                       # [P, k, V]: drawn before draw j
    rows = q[:, None] * (1 - earlier)
    return rows / rows.sum(-1, keepdim=True).clamp_min(1e-30)


def draft_tree(params, span: int, given: list[int], tree: Topology, levels: list[tuple], device,
               gen: torch.Generator | None = None, root_log_q: torch.Tensor | None = None):
    """(tokens [N], draft_probs [N, V] or None) of `tree`'s nodes up to depth len(levels) from the
    circuit `params` (batch 1, `span` positions) after the kept bytes `given`, depth by depth: one batched
    conditional query over the depth's parents, then each child's byte is the rank-th of the
    parent's conditional (greedy, `gen` None) or its rank-th Gumbel top-k draw from `gen`, i.e.
    without replacement (sampling, with `sibling_probs` as its draft_probs row). `root_log_q`
    [1, V]: depth 1's query (the conditional after `given`), when the caller already has it."""
    m = len(given)
    N = sum(d <= len(levels) for d in tree.depths)  # paths sort by depth: the first N nodes
    prefix = torch.zeros(N + 1, span, dtype=torch.long, device=device)  # [N + 1, span]: row j = node j's path
    prefix[:, :m] = torch.tensor(given, dtype=torch.long, device=device)
    tokens = torch.zeros(N, dtype=torch.long, device=device)
    probs = None
    for d, (nodes, parents, index, ranks, k) in enumerate(levels, start=1):
        i = m + d - 1
        if d == 1 and root_log_q is not None:  # the root is depth 1's only parent
            log_q = root_log_q
        else:
            batch = params.index(torch.zeros(len(parents), dtype=torch.long, device=device))
            log_q = next_log_probs_posterior(batch, prefix[parents], i)  # [P, V]: q(x_i | each parent's path)
        if gen is not None:  # Gumbel top-k: k draws without replacement, in order
            u = torch.rand(log_q.shape, generator=gen, device=log_q.device, dtype=log_q.dtype)
            order = (log_q - (-u.clamp_min(1e-20).log()).log()).topk(k, -1).indices  # [P, k]
            if probs is None:
                probs = torch.zeros(N, log_q.shape[-1], dtype=log_q.dtype, device=log_q.device)
            probs[nodes - 1] = sibling_probs(log_q.exp(), order)[index, ranks]
        else:  # ties as argmax breaks them (stable: the lower byte first)
            order = log_q.sort(dim=-1, descending=True, stable=True).indices[:, :k]
        tokens[nodes - 1] = order[index, ranks]
        prefix[nodes] = prefix[parents[index]]
        prefix[nodes, i] = tokens[nodes - 1]
    return tokens, probs


def chain_log_top1(params, prefix: torch.Tensor, first: int, depth: int) -> torch.Tensor:
    """[B, depth]: log of the circuit's top-1 conditional probability at positions first ..
    first + depth - 1 along its own top-1 chain, after the bytes prefix[:, :first] (`params` and
    `prefix` [B, span] batched alike; `prefix` is overwritten from `first` on by the chain)."""
    out = []
    for i in range(first, first + depth):
        top = next_log_probs_posterior(params, prefix, i).max(-1)
        out.append(top.values)
        prefix[:, i] = top.indices
    return torch.stack(out, -1) if out else prefix.new_zeros(prefix.shape[0], 0, dtype=torch.float)


def chain_value(params, span: int, given: list[int], depth: int, device) -> tuple[list[float], torch.Tensor]:
    """(the head's factors of the path values, the first conditional [1, V]): its top-1
    conditional probabilities along its top-1 chain of `depth` >= 1 bytes after `given` (one host
    read; depth 1 is one query, the one `draft_tree` reuses as its `root_log_q`)."""
    m = len(given)
    prefix = torch.zeros(1, span, dtype=torch.long, device=device)
    prefix[0, :m] = torch.tensor(given, dtype=torch.long, device=device)
    root = next_log_probs_posterior(params, prefix, m)  # [1, V]
    top = root.max(-1)
    prefix[:, m] = top.indices
    return torch.cat([top.values, chain_log_top1(params, prefix, m + 1, depth - 1)[0]]).exp().tolist(), root
