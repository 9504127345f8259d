"""Training-free mask-token probing (ESP: "Efficient Training-Free Multi-Token Prediction via
Embedding-Space Probing", Goel et al., arXiv:2603.17942).

Mask tokens synthesised in the target's embedding space are attached after the root and
after every draft node of each verifier step; the masks after the deepest accepted node
predict the tokens that follow the bonus token, so one forward verifies the current draft
and proposes the next ("parallel verification and generation", Sec. 3.3, Fig. 1).

- Mask embeddings (Sec. 3.1): `mean` of the prompt embeddings (soft, default), `hard` = the
  last k prompt embeddings, `sample` ~ N(mu, sigma^2 I) of the embedding table; updated after
  every generated token e with m <- m + lambda (e - m), lambda = 0.1 (Eq. 4).
- Block complexity BC = (k+1)(1 + sum_i K_i) (Eq. 6): the number of input positions per
  forward; a budget BC leaves B - 1 = BC // (k+1) - 1 draft nodes.
- Dynamic tree (Alg. 1, App. D): top-1 expansion; depth-1 candidates are the top tokens of
  mask 1, the best node of depth i-1 gets the top tokens of mask i as children with
  cumulative probability P(child) = P(parent) p_i(token); the best B - 1 nodes are kept.
  A static tree `K1-K2-...` keeps K_i children under the top-1 node of depth i-1 instead.
- Pruning (Sec. 3.5): a candidate equal to its parent or to the last token is replaced by
  the next best.
Presets BC = 10, 30, 60 use 1, 1 and 2 masks as in the paper (Sec. 4).
- Rank trees (`tree=` a bank of eval/tree_frontier.py --method probe, or chainN): trees of the
  masks' top-ranked tokens and a run-time schedule among them (`mtpkit.models.trees.MaskTreeDrafting`,
  shared with the gated-LoRA drafter) instead of Alg. 1.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from mtpkit.models.decoding.drafter import Draft, Drafter, StepOutput
from mtpkit.models.method import Method
from mtpkit.models.trees import MaskTreeDrafting, MaskTreeOptions, check_ranks

INITS = ("mean", "hard", "sample")


@dataclass
class ProbeConfig(MaskTreeOptions):
    bc: int = 30
    """block complexity: input positions per forward (root + drafts + their masks): larger where a
    step of more rows costs little more than one row (a GPU); the paper's presets are 10, 30, 60"""
    masks: int = 0
    """mask tokens k per node; 0 = the paper's choice (1 up to BC 30, else 2): more to draft deeper"""
    init: str = "mean"
    """mask embedding init (Sec. 3.1): mean (the paper's default) | hard | sample, the paper's
    alternatives"""
    lam: float = 0.1
    """mask update rate lambda of Eq. 4: higher follows the generated text faster; 0 keeps the init"""
    prune: bool = True
    """replace candidates equal to their parent or the last token (Sec. 3.5); 0 only to measure
    what pruning gains"""
    tree: str = "dynamic"
    """`dynamic` (Alg. 1, under the `bc` budget), static branch counts per depth such as `7-2`, or a
    draft tree of rank paths with a mask block on chosen nodes (mtpkit.models.trees): a bank file
    written by eval/tree_frontier.py --method probe (with `schedule`, `task`, `index`, `log`), or
    chainN (N top-1 tokens); a rank tree ignores `bc` and `prune`, and its blocks hold as many
    masks as its deepest tree has levels (or `masks`, if set)"""
    seed: int = 0
    """seed of the `sample` init: another seed, another draw"""


def _top_candidates(dists: torch.Tensor, width: int) -> tuple[list[list[int]], list[list[float]]]:
    """The `width` most probable tokens of each row of `dists` [k, V] and their probabilities,
    best first, as host lists read in ONE transfer (on a GPU every read waits for the device)."""
    values, ids = dists.topk(min(width, dists.shape[-1]), dim=-1)  # [k, width] each
    table = torch.cat([ids.double(), values.double()]).tolist()  # float64 holds every id exactly
    k = dists.shape[0]
    return [[int(i) for i in row] for row in table[:k]], table[k:]


def build_tree(dists: torch.Tensor, root_token: int, num_nodes: int, branches: list[int] | None,
               prune: bool) -> tuple[list[int], list[int]]:
    """Draft tree from the k mask distributions `dists` [k, V].

    Returns (tokens, parents) with parents indexing 0 = root, j = j-th returned node, parents
    listed before children. `branches` None = dynamic (best `num_nodes` by cumulative probability).
    """
    k = dists.shape[0]
    widths = [num_nodes] * k if branches is None else branches
    # every depth's candidates at once: its width, plus the (at most 2) tokens pruning may drop
    ids, values = _top_candidates(dists, max(widths) + (2 if prune else 0))
    nodes = []  # (score, depth, token, parent position in `nodes` or -1 for the root)
    parent, parent_token, parent_score = -1, root_token, 1.0
    for depth in range(1, k + 1):
        width = widths[depth - 1]
        exclude = {parent_token, root_token} if prune else set()
        keep = [(i, v) for i, v in zip(ids[depth - 1], values[depth - 1]) if i not in exclude][:width]
        toks, probs = [i for i, _ in keep], [v for _, v in keep]
        if not toks:
            break
        first = len(nodes)
        nodes += [(parent_score * p, depth, t, parent) for t, p in zip(toks, probs)]
        parent, parent_token, parent_score = first, toks[0], parent_score * probs[0]  # top-1 expands
    order = sorted(range(len(nodes)), key=lambda i: (-nodes[i][0], nodes[i][1]))
    chosen = set(order[:num_nodes]) if branches is None else set(order)
    chosen = {i for i in chosen if nodes[i][3] == -1 or nodes[i][3] in chosen}
    kept = sorted(chosen, key=lambda i: (nodes[i][1], -nodes[i][0]))
    position = {i: j + 1 for j, i in enumerate(kept)}
    return [nodes[i][2] for i in kept], [0 if nodes[i][3] == -1 else position[nodes[i][3]] for i in kept]


class ProbeDrafter(MaskTreeDrafting, Drafter):
    name = "probe"

    def __init__(self, config: ProbeConfig = ProbeConfig()):
        c = config
        if c.init not in INITS:
            raise ValueError(f"probe init must be one of {INITS}, got {c.init!r}")
        self.config = c
        if c.tree != "dynamic" and not re.fullmatch(r"\d+(-\d+)*", c.tree):  # a rank tree (bank or chainN)
            self.setup_trees(c, "probe")
            self.k = c.masks or max(self.trees[i].depth for i in self.schedule.trees)
            return
        if c.blocks:
            raise ValueError(f"probe blocks={c.blocks}: mask-block placement is for a rank tree (tree=chainN, rank "
                             f"paths or a bank), not tree={c.tree}")
        self.k = c.masks or (1 if c.bc <= 30 else 2)
        if c.tree == "dynamic":
            self.branches = None
            self.num_nodes = c.bc // (self.k + 1) - 1
        else:
            try:
                self.branches = [int(b) for b in c.tree.split("-")]
            except ValueError:
                raise ValueError(f"probe tree must be `dynamic` or branch counts like 7-2, got {c.tree!r}") from None
            if len(self.branches) != self.k or min(self.branches) < 1:
                raise ValueError(f"probe tree {c.tree!r} needs {self.k} positive branch counts (one per mask)")
            self.num_nodes = sum(self.branches)
        if self.num_nodes < 1:
            raise ValueError(f"probe bc={c.bc} leaves no draft node with {self.k} masks (need bc >= {2 * (self.k + 1)})")

    def adapt(self, model, shared: dict):
        if self.trees is not None:  # rank r is the (r+1)-th token: checked before any decode
            check_ranks(self.trees, model.get_output_embeddings().weight.shape[0], f"probe tree={self.config.tree!r}")
        return super().adapt(model, shared)

    def begin(self, target, prompt_ids: list[int]) -> None:
        table = target.embed.weight.detach()  # [V, d]
        prompt = table[torch.tensor(prompt_ids, device=table.device)]
        if self.config.init == "mean":
            masks = prompt.mean(0, keepdim=True).repeat(self.k, 1)
        elif self.config.init == "hard":
            masks = prompt[-self.k:]
            masks = torch.cat([masks[:1].repeat(self.k - len(masks), 1), masks])  # prompt shorter than k
        else:
            # sigma = sqrt(mean_j ||e_j - mu||^2) is a norm; spread it over the d dimensions so
            # the samples have the same expected distance to mu as the real embeddings
            mu = table.mean(0)
            sigma = (table - mu).pow(2).sum(-1).mean().sqrt() / math.sqrt(table.shape[1])
            gen = torch.Generator(device=table.device).manual_seed(self.config.seed)
            masks = mu + sigma * torch.randn(self.k, table.shape[1], generator=gen, device=table.device)
        self.masks = masks.clone()  # [k, d]
        self.table = table
        self.dists = None  # [k, V] mask outputs after the last accepted node
        self.mask_rows: list[list[int]] = []
        if self.trees is not None:  # its blocks use a view of the first rows: Eq. 4's updates (in place) show
            self.begin_trees(self.masks)

    def propose(self, tokens: list[int]) -> Draft:
        if self.trees is not None:
            return self.propose_tree()
        if self.dists is None:
            draft_tokens, parents = [], []
        else:
            draft_tokens, parents = build_tree(self.dists, tokens[-1], self.num_nodes, self.branches,
                                               self.config.prune)
        N, k = len(draft_tokens), self.k
        # k masks after the root and after every draft node: mask 1's parent is the node,
        # mask i's parent is mask i-1 (so mask i sits at the node's position + i)
        extra_parents, self.mask_rows = [], []
        for node in range(N + 1):
            first = N + 1 + node * k
            self.mask_rows.append(list(range(first, first + k)))
            extra_parents += [node] + list(range(first, first + k - 1))
        return Draft(tokens=draft_tokens, parents=parents,
                     extra_embeds=self.masks.repeat(N + 1, 1), extra_parents=extra_parents)

    def observe(self, step: StepOutput) -> None:
        if self.trees is not None:
            self.observe_tree(step)
        else:
            self.dists = torch.softmax(step.logits(self.mask_rows[step.last_node]), dim=-1)  # [k, V]
        for token in step.new_tokens:  # Eq. 4, once per generated token
            self.masks += self.config.lam * (self.table[token] - self.masks)


METHOD = Method(name="probe", summary="training-free mask-token probing (dynamic draft tree under a block-complexity "
                                      "budget)", options=ProbeConfig, drafter=ProbeDrafter)
