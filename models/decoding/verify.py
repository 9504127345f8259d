"""Tree attention layout and acceptance rules of the verifier (pure functions).

Greedy: accept the longest draft path whose tokens equal the target's argmax, plus the bonus
token (the target's own choice after the last accepted node).
Sampling: recursive rejection sampling over the children of each node (SpecInfer, Miao et al.
2024; for a single chain it is Leviathan et al. 2023): child x drawn from q is accepted with
probability min(1, p(x) / q(x)); on rejection p <- normalise(max(p - q, 0)) and the next
sibling is tried; when every child is rejected the bonus is drawn from the residual p. A
deterministic candidate (top-k, n-gram) has q = one-hot(x). The output is distributed exactly
as the target's.
"""

from __future__ import annotations

from typing import Callable

import torch

from mtpkit.models.trees import tree_layout


def attention_inputs(parents: tuple[int, ...], cache_len: int, dtype: torch.dtype, device=None, layout=None):
    """4D additive mask [1, 1, Q, cache_len + Q] and position ids [1, Q] for one forward
    (`layout`: `tree_layout(parents)` precompiled, else built here and cached)."""
    allowed, depth = layout if layout is not None else tree_layout(parents)
    Q = len(depth)
    mask = torch.full((Q, cache_len + Q), torch.finfo(dtype).min, dtype=dtype, device=device)
    mask[:, :cache_len] = 0.0  # every node sees the whole accepted past
    mask[:, cache_len:].masked_fill_(allowed.to(device), 0.0)
    return mask[None, None], (depth + cache_len)[None].to(device)


def accept_on_device(argmaxes: torch.Tensor, step_tokens: torch.Tensor,
                     layout: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Greedy acceptance on the device: the deepest step node whose every node on the path from the
    root holds the target's argmax after its parent, as a 0-dim tensor (0 = nothing accepted).

    `argmaxes` [>= 1+N] the target's argmax after each step row (root first), `step_tokens` [1+N]
    the root's and the draft nodes' tokens, `layout` the step's tree (`tree_layout`: ancestor-or-self
    mask and depths, root first; extra nodes after the drafts are ignored) on the device, None for
    a chain. A chain accepts the length of its matching prefix, Medusa's cumulative product of
    matches; a tree takes the same product along every root-to-node path at once through the
    ancestor mask (a node is reachable when no ancestor mismatches), then the first deepest
    reachable node. It accepts the tokens `walk_greedy` accepts (both are the target's own greedy
    choices); where siblings hold one token it may keep another of them."""
    n = step_tokens.shape[0]
    if layout is None:
        matches = step_tokens[1:] == argmaxes[: n - 1]
        return matches.long().cumprod(0).sum()
    allowed, depth = layout[0][:n, :n], layout[1][:n]
    parent = (allowed & (depth[None, :] == depth[:, None] - 1)).long().argmax(-1)  # the root: 0, itself
    holds = (step_tokens == argmaxes[parent]) | (depth == 0)
    reachable = ~(allowed & ~holds[None, :]).any(-1)
    return (depth * reachable).argmax()


def path_to(node: int, parents: list[int]) -> list[int]:
    """Draft nodes from the root (excluded) down to `node` (0: none), by the draft's host parents."""
    path = []
    while node:
        path.append(node)
        node = parents[node - 1]
    return path[::-1]


def verify_greedy(logits: Callable[[int], torch.Tensor], children: list[list[int]],
                  tokens: list[int]) -> tuple[list[int], int, int]:
    """Walk from the root while a child holds the target's argmax.

    logits(node) -> [V]; tokens[node] is the node's token (tokens[0], the root's, unused).
    Returns (accepted nodes, last accepted node, bonus token).
    """
    return walk_greedy(lambda node: int(logits(node).argmax()), children, tokens)


def walk_greedy(argmax: Callable[[int], int], children: list[list[int]],
                tokens: list[int]) -> tuple[list[int], int, int]:
    """`verify_greedy` on the target's argmax token after each node, `argmax(node)` (e.g. argmaxes
    already read to the host)."""
    node, path = 0, []
    while True:
        best = argmax(node)
        nxt = next((c for c in children[node] if tokens[c] == best), None)
        if nxt is None:
            return path, node, best
        path.append(nxt)
        node = nxt


def verify_sampling(probs: Callable[[int], torch.Tensor], children: list[list[int]], tokens: list[int],
                    draft_probs: torch.Tensor | None, generator: torch.Generator | None = None
                    ) -> tuple[list[int], int, int]:
    """Recursive rejection sampling down the tree (see module docstring).

    probs(node) -> target distribution [V] after the node; draft_probs[j - 1] is the
    distribution draft node j was drawn from (None: all drafts deterministic, one-hot).
    """
    node, path = 0, []
    while True:
        p = probs(node).clone()
        for child in children[node]:
            x = tokens[child]
            if draft_probs is None:
                q = torch.zeros_like(p)
                q[x] = 1.0
            else:
                q = draft_probs[child - 1].to(p.dtype)
            u = torch.rand((), generator=generator, device=p.device)  # the generator is on p's device
            if q[x] > 0 and u < torch.clamp(p[x] / q[x], max=1.0):
                path.append(child)
                node = child
                break
            residual = torch.clamp(p - q, min=0.0)
            if residual.sum() > 0:  # == 0 only if p == q, where rejection had probability 0
                p = residual / residual.sum()
        else:
            bonus = int(torch.multinomial(p, 1, generator=generator))
            return path, node, bonus
