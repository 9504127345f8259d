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


def accept_on_device(choices: torch.Tensor, step_tokens: torch.Tensor,
                     layout: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Acceptance on the device: the deepest step node whose every node on the path from the root
    holds the target's choice after its parent, as a 0-dim tensor (0 = nothing accepted).

    `choices` [>= 1+N] the target's choice after each step row, root first (its argmax when greedy,
    one draw from its distribution when sampling: see `sample_on_device`), `step_tokens` [1+N] the
    root's and the draft nodes' tokens, `layout` the step's tree (`tree_layout`: ancestor-or-self
    mask and depths, root first; extra nodes after the drafts are ignored) on the device, None for
    a chain. A chain accepts the length of its matching prefix, Medusa's cumulative product of
    matches; a tree takes the same product along every root-to-node path at once through the
    ancestor mask (a node is reachable when no ancestor mismatches), then the deepest reachable
    node. A node whose earlier sibling holds the same token never holds (as in `walk_greedy`, the
    first such sibling is the one taken), so at most one child of a node holds and the reachable
    nodes are one path: what `walk_greedy` accepts, node for node."""
    n = step_tokens.shape[0]
    if layout is None:
        matches = step_tokens[1:] == choices[: n - 1]
        return matches.long().cumprod(0).sum()
    allowed, depth = layout[0][:n, :n], layout[1][:n]
    parent = (allowed & (depth[None, :] == depth[:, None] - 1)).long().argmax(-1)  # the root: 0, itself
    earlier_twin = ((parent[:, None] == parent[None, :]) & (step_tokens[:, None] == step_tokens[None, :])
                    ).tril(-1)[:, 1:].any(-1)  # an earlier draft sibling (the root is no sibling) holds my token
    holds = ((step_tokens == choices[parent]) & ~earlier_twin) | (depth == 0)
    reachable = ~(allowed & ~holds[None, :]).any(-1)
    return (depth * reachable).argmax()


def draw(weights: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token from each row of `weights` [R, V] (>= 0, any positive sum), on their device without a
    host read: the argmax of weights / Exp(1) noise (the exponential race, the Gumbel-max trick)."""
    noise = torch.empty_like(weights).exponential_(generator=generator)
    return (weights / noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(-1)


def sample_on_device(probs: torch.Tensor, step_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                     layout: tuple[torch.Tensor, torch.Tensor] | None = None,
                     generator: torch.Generator | None = None) -> torch.Tensor:
    """Speculative sampling on the device, exact in distribution: [2] = (last accepted node, bonus).

    `probs` [>= 1+N, V] the target's distribution after each step row (root first), `step_tokens`
    [1+N], `layout` as in `accept_on_device` (None: a chain). Two cases are vectorized:
    - deterministic drafts (`draft_probs` None: top-k, n-gram), chain or tree: a draw y_n from the
      target after every node, and a child is accepted when its token is its parent's draw. With
      q = one-hot, recursive rejection accepts sibling x_i with probability p(x_i) / (1 - the mass
      of the siblings rejected before it), the chance that y equals x_i given it equals none of
      them; when no sibling is taken the bonus from the residual is y itself. So the tokens are
      those of `verify_sampling`, in distribution.
    - a chain drawn from `draft_probs` (Leviathan et al.): node i accepted when u_i < p(x_i) / q(x_i)
      for every node up to it (a cumulative product), the bonus drawn from the residual
      max(p - q, 0) at the first rejected node, or from the target after the last node.
    A tree of drawn drafts is sequential by nature (a rejected sibling's residual changes the next
    sibling's test): `verify_sampling` walks it on the host."""
    n = step_tokens.shape[0]
    p = probs[:n]
    if draft_probs is None:
        y = draw(p, generator)
        last = accept_on_device(y, step_tokens, layout)
        return torch.stack([last, y[last]])
    if layout is not None:
        raise ValueError("sample_on_device: drawn drafts are vectorized on chains only")
    x = step_tokens[1:, None]
    q = draft_probs[: n - 1].to(p)
    px, qx = p[:-1].gather(1, x)[:, 0], q.gather(1, x)[:, 0]
    u = torch.rand(n - 1, generator=generator, device=p.device, dtype=p.dtype)
    last = ((qx > 0) & (u * qx < px)).long().cumprod(0).sum()  # u < min(1, p(x) / q(x))
    residual = torch.cat([(p[:-1] - q).clamp_min(0.0), p[-1:]])
    # a zero residual only where p == q, whose node is accepted with probability 1: never drawn from
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
    return torch.stack([last, draw(residual, generator)[last]])


def read_decision(decision: torch.Tensor, signal: torch.Tensor | None) -> tuple[list, list[float] | None]:
    """The step's ONE host read: the acceptance decision (integers on the device) and, when a drafter
    asked for them (`Drafter.step_signal`), its floats in the same read; float64 holds every token id
    and node index exactly. Returns (the integers, the floats or None)."""
    if signal is None:
        return decision.tolist(), None
    n = decision.numel()
    both = torch.cat([decision.double(), signal.detach().double().flatten()]).tolist()
    return [int(x) for x in both[:n]], both[n:]


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
