"""Native tensor code for the four MTPC circuit structures (arXiv:2511.11346, Sec. 3.2, App. B).

A circuit over a window of `n` tokens with vocabulary `V` and rank `r` is given, per example,
by its input units and its sum-unit weights (`CircuitParams`):

- `log_phi` [B, n, r, V]: log-probabilities of the categorical input unit j at window position i
  (FF has r = 1);
- `root` [B, r]: the output sum unit's weights (CP mixture weights, HMM initial state, BTree
  root) -- absent for FF;
- `inner` [B, L, r, r] (HMM, BTree): the inner sum layers' weights `W[o, i]` (row o is the
  distribution over the inputs of output unit o; rows sum to 1).

Semantics, written as the circuits cirkit builds (`models/mtpc/circuit_cirkit.py` builds the same
four as symbolic circuits, and the tests check that both agree):

- FF:    q(x) = prod_i phi_i(x_i)
- CP:    q(x) = sum_z root[z] prod_i phi_{i,z}(x_i)
- HMM:   q(x) = sum_z root[z0] phi_{0,z0}(x_0) prod_{i>=1} inner[i-1][z_{i-1}, z_i] phi_{i,z_i}(x_i)
- BTree: leaves phi_i [r]; an inner node over the contiguous span S = left + right is
  c_S[o] = sum_i W_S[o, i] c_left[i] c_right[i]; the output is sum_i root[i] c_L[i] c_R[i].
  `inner` lists the nodes level by level, bottom-up, left to right (n/2 + n/4 + ... + 2 nodes);
  n must be a power of two.

Everything runs in log space. Marginalising a position replaces its input units by 1 (log 0),
which is exact because every unit is normalised. Queries: `log_prob` (with an `observed` mask),
`prefix_log_probs` (all q(x_1..i) at once, Algorithm 3 line 9; BTree in O(n log n) matvecs), `next_log_probs` (the
conditional of one position given a prefix, for the residual of speculative sampling),
`sample` (ancestral, top-down, Algorithm 1) and `mode` (max-product upward pass and
backtracking, the greedy draft).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

ARCHS = ("ff", "cp", "hmm", "btree")


class CircuitParams(NamedTuple):
    """A circuit's parameters for a batch of examples. A NamedTuple, so DeepSpeed ZeRO-3's hooks
    see its tensors (they look inside tuples, lists and dicts) and re-gather the head's split
    weights for the backward."""
    arch: str
    log_phi: torch.Tensor                 # [B, n, r, V]
    root: torch.Tensor | None = None      # [B, r]
    inner: torch.Tensor | None = None     # [B, L, r, r]

    @property
    def n(self) -> int:
        return self.log_phi.shape[1]

    @property
    def r(self) -> int:
        return self.log_phi.shape[2]

    def index(self, rows: torch.Tensor) -> "CircuitParams":
        """The parameters of the examples `rows` (a LongTensor), e.g. to repeat each one."""
        pick = lambda t: None if t is None else t[rows]  # noqa: E731
        return CircuitParams(self.arch, self.log_phi[rows], pick(self.root), pick(self.inner))


def num_inner(arch: str, n: int) -> int:
    """Inner sum layers of a structure (each r x r)."""
    if arch == "hmm":
        return n - 1
    if arch == "btree":
        if n < 2 or n & (n - 1):
            raise ValueError(f"btree needs a power-of-two window, got n={n}")
        return n - 2  # n/2 + n/4 + ... + 2
    return 0


def _btree_levels(n: int) -> list[tuple[int, int]]:
    """(first index into `inner`, number of nodes) per inner level, bottom-up; the root is apart."""
    levels, start, nodes = [], 0, n // 2
    while nodes > 1:
        levels.append((start, nodes))
        start, nodes = start + nodes, nodes // 2
    return levels


class _LogMatVec(torch.autograd.Function):
    """log(W @ exp(v)) over the last axes, with W in probability space (zeros allowed).

    Autograd through `log(W)` would give 0 * inf = NaN wherever a weight is exactly 0 (an HMM
    transition initialised to the identity), although the true gradient there is finite:
    d out_o / d W_oi = exp(v_i - out_o). The backward pass below uses that closed form.
    """

    @staticmethod
    def forward(ctx, w, log_v):  # w [..., o, i], log_v [..., i]
        out = torch.logsumexp(w.log() + log_v.unsqueeze(-2), dim=-1)  # [..., o]
        ctx.save_for_backward(w, log_v, out)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        w, log_v, out = ctx.saved_tensors
        # exp(v_i - out_o), capped so a unit far likelier than what its row selects cannot overflow
        ratio = (log_v.unsqueeze(-2) - out.unsqueeze(-1)).clamp(max=60.0).exp()  # [..., o, i]
        grad_w = grad_out.unsqueeze(-1) * ratio
        grad_v = (grad_w * w).sum(-2)
        return grad_w, grad_v


def _logmatvec(w: torch.Tensor, log_v: torch.Tensor) -> torch.Tensor:
    """log(W @ exp(v)): w [..., o, i] probabilities, log_v [..., i] -> [..., o]."""
    return _LogMatVec.apply(w, log_v)


def leaf_values(params: CircuitParams, x: torch.Tensor, observed: torch.Tensor | None = None) -> torch.Tensor:
    """log phi_{i,j}(x_i) [B, n, r], 0 (i.e. marginalised) where `observed` is False."""
    V = params.log_phi.shape[-1]
    idx = x.clamp(0, V - 1)[:, :, None, None].expand(-1, -1, params.r, 1)
    values = params.log_phi.gather(-1, idx).squeeze(-1)
    if observed is not None:
        values = values.masked_fill(~observed[:, :, None], 0.0)
    return values


def upward(params: CircuitParams, leaves: torch.Tensor) -> torch.Tensor:
    """log q from input-unit log values `leaves` [B, n, r] (sum-product, log space) -> [B]."""
    arch = params.arch
    if arch == "ff":
        return leaves[..., 0].sum(-1)
    log_root = params.root.log()
    if arch == "cp":
        return torch.logsumexp(log_root + leaves.sum(1), dim=-1)
    if arch == "hmm":  # from the last position back: c_i = leaf_i + log(W_i exp(c_{i+1}))
        c = leaves[:, -1]
        for i in range(params.n - 2, -1, -1):
            c = leaves[:, i] + _logmatvec(params.inner[:, i], c)
        return torch.logsumexp(log_root + c, dim=-1)
    if arch == "btree":
        c = leaves  # [B, nodes, r]
        for start, nodes in _btree_levels(params.n):
            prod = c[:, 0::2] + c[:, 1::2]                               # [B, nodes, r]
            c = _logmatvec(params.inner[:, start:start + nodes], prod)
        return torch.logsumexp(log_root + c[:, 0] + c[:, 1], dim=-1)
    raise ValueError(f"unknown circuit arch {arch!r}; choose from {ARCHS}")


def log_prob(params: CircuitParams, x: torch.Tensor, observed: torch.Tensor | None = None) -> torch.Tensor:
    """log q(x_observed) [B] for windows x [B, n] (unobserved positions summed out)."""
    if not isinstance(params, CircuitParams):  # a plugged-in cirkit circuit (models/mtpc/cirkit_head.py)
        return params.log_prob(x, observed)
    return upward(params, leaf_values(params, x, observed))


def prefix_log_probs(params: CircuitParams, x: torch.Tensor, observed: torch.Tensor | None = None) -> torch.Tensor:
    """[B, n]: entry i is log q(x_1..x_{i+1}) with later positions summed out (and unobserved
    ones everywhere). FF and CP use running sums, HMM one forward pass, BTree `_btree_prefixes`."""
    if not isinstance(params, CircuitParams):
        return params.prefix_log_probs(x, observed)
    leaves = leaf_values(params, x, observed)  # [B, n, r]
    arch, n = params.arch, params.n
    if arch == "ff":
        return leaves[..., 0].cumsum(1)
    if arch == "cp":
        return torch.logsumexp(params.root.log()[:, None] + leaves.cumsum(1), dim=-1)
    if arch == "hmm":  # forward algorithm: alpha_i[z] = q(x_1..i, z_i = z)
        alpha = params.root.log() + leaves[:, 0]
        out = [torch.logsumexp(alpha, -1)]
        for i in range(1, n):
            alpha = _logmatvec(params.inner[:, i - 1].transpose(-1, -2), alpha) + leaves[:, i]
            out.append(torch.logsumexp(alpha, -1))
        return torch.stack(out, 1)
    return _btree_prefixes(params, leaves)


def _btree_prefixes(params: CircuitParams, leaves: torch.Tensor) -> torch.Tensor:
    """All prefix marginals of a BTree in one upward pass plus one matrix-vector product per
    prefix and level. A node whose span lies after the prefix is summed out entirely and
    evaluates to 1 (log 0: normalised units); one before it keeps its ordinary value C; so only
    the node holding the prefix's last position p needs its own value P, per level:
        P_level[p] = W_node(p) (P_below[p] + [p in the node's right half] C_below[left child])
    with P_leaves[p] = the leaf value at p."""
    n = params.n
    pos = torch.arange(n, device=leaves.device)
    complete, partial = leaves, leaves  # [B, nodes, r], [B, n, r]
    for level, (start, nodes) in enumerate(_btree_levels(n)):
        span = 2 ** (level + 1)
        node = pos // span
        right = ((pos % span) >= span // 2)[None, :, None]
        partial = _logmatvec(params.inner[:, start + node],
                             partial + torch.where(right, complete[:, 2 * node], 0.0))
        complete = _logmatvec(params.inner[:, start:start + nodes], complete[:, 0::2] + complete[:, 1::2])
    right = (pos >= n // 2)[None, :, None]
    joint = partial + torch.where(right, complete[:, 0:1].expand(-1, n, -1), 0.0)
    return torch.logsumexp(params.root.log()[:, None] + joint, dim=-1)


def next_log_probs(params: CircuitParams, prefix: torch.Tensor, i: int) -> torch.Tensor:
    """log q(X_i = v | x_0..x_{i-1}) for every v: [B, V] (prefix [B, n], positions < i used).
    One upward pass over B * V rows whose leaves differ only at position i."""
    if not isinstance(params, CircuitParams):
        return params.next_log_probs(prefix, i)
    B, n, r, V = params.log_phi.shape
    observed = torch.zeros(B, n, dtype=torch.bool, device=prefix.device)
    observed[:, :i] = True
    leaves = leaf_values(params, prefix, observed)                              # [B, n, r]
    leaves = leaves[:, None].repeat(1, V, 1, 1)                                # [B, V, n, r]
    leaves[:, :, i] = params.log_phi[:, i].transpose(-1, -2)                   # [B, V, r]
    rows = torch.arange(B, device=prefix.device).repeat_interleave(V)
    pick = lambda t: None if t is None else t[rows]  # noqa: E731
    shared = CircuitParams(params.arch, params.log_phi[:1].expand(B * V, -1, -1, -1), pick(params.root),
                           pick(params.inner))  # the expanded log_phi is a view: only its shape is read
    joint = upward(shared, leaves.view(B * V, n, r)).view(B, V)
    return joint - torch.logsumexp(joint, dim=-1, keepdim=True)


@torch.no_grad()
def next_log_probs_posterior(params: CircuitParams, prefix: torch.Tensor, i: int) -> torch.Tensor:
    """`next_log_probs` in closed form, without V upward passes (no gradient: for decoding).
    The circuit is multilinear in position i's input units, so with later positions summed out
    q(x_<i, X_i = v) = sum_u G_u phi_{i,u}(v), where G_u is the derivative of the output with
    respect to unit u (its "outside" value given the prefix); so q(X_i | x_<i) = sum_u pi_u
    phi_{i,u} with pi = G / sum(G), the posterior of position i's unit given the prefix.
    FF: pi is trivial; CP: root * prod of the prefix leaves; HMM: the forward algorithm's
    prediction; BTree: `_btree_outside`, top-down along i's path."""
    if not isinstance(params, CircuitParams):
        return params.next_log_probs(prefix, i)
    arch, n = params.arch, params.n
    if arch == "ff":
        return params.log_phi[:, i, 0]
    observed = (torch.arange(n, device=prefix.device) < i)[None].expand(prefix.shape[0], n)
    leaves = leaf_values(params, prefix, observed)  # [B, n, r]; positions >= i summed out
    if arch == "cp":
        log_outside = params.root.log() + leaves[:, :i].sum(1)
    elif arch == "hmm":  # alpha_p = q(x_<=p, z_p); predicted: q(x_<i, z_i) = W_{i-1}^T alpha_{i-1}
        log_outside = params.root.log()
        for p in range(i):
            log_outside = _logmatvec(params.inner[:, p].transpose(-1, -2), log_outside + leaves[:, p])
    elif arch == "btree":
        log_outside = _btree_outside(params, leaves, i)
    else:
        raise ValueError(f"unknown circuit arch {arch!r}; choose from {ARCHS}")
    return torch.logsumexp(log_outside.log_softmax(-1)[:, :, None] + params.log_phi[:, i], dim=1)  # [B, V]


def _btree_outside(params: CircuitParams, leaves: torch.Tensor, i: int) -> torch.Tensor:
    """log outside values [B, r] of leaf i's units: d q / d leaf_{i,u} with `leaves` [B, n, r]
    (positions >= i summed out). One upward pass keeps every node's value c; then top-down along
    i's path, each node's outside value is pushed through its parent's weights and multiplied by
    its sibling's value (complete if the sibling lies before i, 1 if after):
        G_child[u] = sum_o G_parent[o] W_parent[o, u] * c_sibling[u],  G_top[u] = root[u] c_sibling[u]."""
    values, c = [leaves], leaves  # values[j]: the nodes spanning 2^j positions
    levels = _btree_levels(params.n)
    for start, nodes in levels:
        c = _logmatvec(params.inner[:, start:start + nodes], c[:, 0::2] + c[:, 1::2])
        values.append(c)
    top = len(levels)
    g = params.root.log() + values[top][:, (i >> top) ^ 1]
    for j in range(top, 0, -1):  # node (j, i >> j) is inner node levels[j - 1][0] + (i >> j)
        w = params.inner[:, levels[j - 1][0] + (i >> j)]
        g = _logmatvec(w.transpose(-1, -2), g) + values[j - 1][:, (i >> (j - 1)) ^ 1]
    return g


def _draw(log_probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One categorical draw per row of the last axis (Gumbel-max)."""
    u = torch.rand(log_probs.shape, generator=generator, device=log_probs.device, dtype=log_probs.dtype)
    gumbel = -(-u.clamp_min(1e-20).log()).log()
    return (log_probs + gumbel).argmax(-1)


def _leaf_states(params: CircuitParams, choose) -> torch.Tensor:
    """The input unit used at every position [B, n], picking sum branches top-down with
    `choose(log_w [..., r], key)` (Algorithm 1): a draw when sampling, an argmax of
    log_w + the upward max-product message `key` names for the mode."""
    B, n, arch = params.log_phi.shape[0], params.n, params.arch
    device = params.log_phi.device
    if arch == "ff":
        return torch.zeros(B, n, dtype=torch.long, device=device)
    log_root = params.root.log()
    if arch == "cp":
        return choose(log_root, "root")[:, None].expand(B, n)
    log_inner = None if params.inner is None else params.inner.log()  # None: a 2-position BTree
    batch = torch.arange(B, device=device)
    if arch == "hmm":
        states = [choose(log_root, ("hmm", 0))]
        for i in range(1, n):
            states.append(choose(log_inner[batch, i - 1, states[-1]], ("hmm", i)))
        return torch.stack(states, 1)
    # btree: the root picks one unit for both halves; every inner node then picks, from the
    # row of its parent's choice, one unit shared by its two children
    state = choose(log_root, "root")[:, None].repeat_interleave(2, 1)  # [B, 2]
    for level, (start, nodes) in reversed(list(enumerate(_btree_levels(n)))):
        node_ids = torch.arange(start, start + nodes, device=device)
        rows = log_inner[batch[:, None], node_ids[None, :], state]  # [B, nodes, r]
        state = choose(rows, ("btree", level)).repeat_interleave(2, 1)
    return state  # [B, n]


def _messages(params: CircuitParams, leaves: torch.Tensor, reduce: str) -> dict:
    """Upward messages below every choice of `_leaf_states`, from input-unit log values
    `leaves` [B, n, r]: sum-product (`reduce="sum"`, log q of the evidence below) or
    max-product (`"max"`)."""
    arch, n = params.arch, params.n
    log_inner = None if params.inner is None else params.inner.log()
    combine = (lambda w, v: torch.logsumexp(w + v.unsqueeze(-2), -1)) if reduce == "sum" \
        else (lambda w, v: (w + v.unsqueeze(-2)).amax(-1))
    messages = {}
    if arch == "cp":
        messages["root"] = leaves.sum(1)
    elif arch == "hmm":
        c = leaves[:, -1]
        messages[("hmm", n - 1)] = c
        for i in range(n - 2, -1, -1):
            c = leaves[:, i] + combine(log_inner[:, i], c)
            messages[("hmm", i)] = c
    elif arch == "btree":
        c = leaves
        for level, (start, nodes) in enumerate(_btree_levels(n)):
            prod = c[:, 0::2] + c[:, 1::2]  # [B, nodes, r]
            messages[("btree", level)] = prod
            c = combine(log_inner[:, start:start + nodes], prod)
        messages["root"] = c[:, 0] + c[:, 1]
    return messages


def sample(params: CircuitParams, generator: torch.Generator | None = None, evidence: torch.Tensor | None = None,
           observed: torch.Tensor | None = None) -> torch.Tensor:
    """One window per example [B, n] by ancestral sampling (App. B.2): branches top-down, then
    all n tokens in parallel from their selected input units. With `evidence` [B, n] on the
    `observed` positions [B, n] (bool), it samples from q(unobserved | observed): every branch
    is drawn in proportion to its weight times the likelihood of the evidence below it (one
    upward sum-product pass), and observed positions keep their evidence. A plugged-in cirkit
    circuit samples position by position from its conditionals instead (exact as well)."""
    if not isinstance(params, CircuitParams):
        return params.chain(lambda log_q: _draw(log_q, generator), evidence, observed)
    states = sample_states(params, generator, evidence, observed)
    units = params.log_phi.gather(2, states[:, :, None, None].expand(-1, -1, 1, params.log_phi.shape[-1]))
    return sample_tokens(units.squeeze(2), generator, evidence, observed)


def sample_states(params: CircuitParams, generator: torch.Generator | None = None,
                  evidence: torch.Tensor | None = None, observed: torch.Tensor | None = None) -> torch.Tensor:
    """The branch half of `sample`: the input unit drawn at every position [B, n]. It reads
    `log_phi` only at the `observed` positions, so a caller can compute the rest lazily."""
    if evidence is None:
        choose = lambda log_w, _: _draw(log_w, generator)  # noqa: E731
    else:
        messages = _messages(params, leaf_values(params, evidence, observed), "sum")
        choose = lambda log_w, key: _draw(log_w + messages[key], generator)  # noqa: E731
    return _leaf_states(params, choose)


def sample_tokens(units: torch.Tensor, generator: torch.Generator | None = None, evidence: torch.Tensor | None = None,
                  observed: torch.Tensor | None = None) -> torch.Tensor:
    """The token half of `sample`: one draw per position from the log-probabilities of its
    selected input unit `units` [B, n, V]; observed positions keep their evidence."""
    drawn = _draw(units, generator)
    return drawn if evidence is None else torch.where(observed, evidence, drawn)


def mode(params: CircuitParams, evidence: torch.Tensor | None = None, observed: torch.Tensor | None = None
         ) -> torch.Tensor:
    """The max-product ("Viterbi") window [B, n]: an upward pass with max instead of sum, then
    the argmax branches top-down. It is the joint mode for FF, CP and HMM, and the mode of the
    latent-augmented tree for BTree (the usual circuit MAP approximation). With `evidence` on
    the `observed` positions, the mode of the rest given them. (A plugged-in cirkit circuit has
    no max-product pass here: it gives `greedy_chain`.)"""
    if not isinstance(params, CircuitParams):
        return params.chain(lambda log_q: log_q.argmax(-1), evidence, observed)
    best_leaf, best_token = params.log_phi.max(-1)  # [B, n, r]: best token of every input unit
    if evidence is not None:
        best_leaf = torch.where(observed[:, :, None], leaf_values(params, evidence), best_leaf)
    if params.arch == "ff":
        states = torch.zeros_like(best_token[..., 0])
    else:
        messages = _messages(params, best_leaf, "max")
        states = _leaf_states(params, lambda log_w, key: (log_w + messages[key]).argmax(-1))
    window = best_token.gather(2, states[:, :, None]).squeeze(2)
    return window if evidence is None else torch.where(observed, evidence, window)


def greedy_chain(params: CircuitParams, evidence: torch.Tensor | None = None, observed: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """Position by position, the argmax of the conditional given the bytes chosen so far
    (x_1 = argmax q(x_1), x_2 = argmax q(x_2 | x_1), ...): n conditional queries instead of one
    max-product pass, but it follows the marginal distribution rather than one latent path.
    For decoding (no gradient)."""
    if not isinstance(params, CircuitParams):
        return params.chain(lambda log_q: log_q.argmax(-1), evidence, observed)
    B, n = params.log_phi.shape[:2]
    window = torch.zeros(B, n, dtype=torch.long, device=params.log_phi.device) if evidence is None else evidence.clone()
    for i in range(n):
        if observed is not None and bool(observed[:, i].all()):
            continue
        window[:, i] = next_log_probs_posterior(params, window, i).argmax(-1)
    return window
