"""MTPC heads: initialisation equivalences, the identity-initialised HMM, the loss."""

import math

import numpy as np
import pytest
import torch

from mtpkit.models.mtpc.circuits import (CircuitParams, _logmatvec, log_prob, next_log_probs, next_log_probs_posterior,
                                    sample, sample_states, sample_tokens)
from mtpkit.models.mtpc.decode import Int8Rows, LazyBTree, _np_softmax, decode_window, weight_as
from mtpkit.models.mtpc.model import MTPCConfig, MTPCHead, window_loss, window_targets

V, D = 11, 8


def lm_head(seed=0):
    return torch.randn(V, D, generator=torch.Generator().manual_seed(seed))


def windows(B, n, seed=1):
    return torch.randint(0, V, (B, n), generator=torch.Generator().manual_seed(seed))


def test_cp_starts_as_ff_and_cp_rank_one_is_ff():
    hidden = torch.randn(5, D)
    x = windows(5, 4)
    ff = MTPCHead(MTPCConfig(arch="ff", n=4), lm_head())
    cp = MTPCHead(MTPCConfig(arch="cp", n=4, r=6), lm_head())
    assert torch.allclose(log_prob(cp(hidden), x), log_prob(ff(hidden), x), atol=1e-5)
    cp1 = MTPCHead(MTPCConfig(arch="cp", n=4, r=1), lm_head())
    with torch.no_grad():
        cp1.unembed.add_(torch.randn_like(cp1.unembed))
        ff.unembed.copy_(cp1.unembed)
    assert torch.allclose(log_prob(cp1(hidden), x), log_prob(ff(hidden), x), atol=1e-5)


def test_identity_initialised_hmm_equals_cp_with_distinct_ranks_and_still_learns():
    """Ranks made different (as after training), gate at its init 0: HMM == CP; and the loss
    gradient reaches the gate and the transition projections (the HMM is not stuck at CP)."""
    hidden = torch.randn(5, D, dtype=torch.float64)
    x = windows(5, 8)
    hmm = MTPCHead(MTPCConfig(arch="hmm", n=8, r=4), lm_head()).double()
    cp = MTPCHead(MTPCConfig(arch="cp", n=8, r=4), lm_head()).double()
    with torch.no_grad():
        hmm.unembed.add_(torch.randn_like(hmm.unembed))
        cp.unembed.copy_(hmm.unembed)
        cp.root.copy_(hmm.root)
    assert float(hmm.gate.detach().abs().max()) == 0.0
    ll_hmm, ll_cp = log_prob(hmm(hidden), x), log_prob(cp(hidden), x)
    assert torch.allclose(ll_hmm, ll_cp, atol=1e-12, rtol=0)
    (-ll_hmm.sum()).backward()
    assert torch.isfinite(hmm.gate.grad).all() and float(hmm.gate.grad.abs().sum()) > 0
    assert float(hmm.inner.grad.abs().sum()) == 0.0  # g = 0 multiplies them ...
    with torch.no_grad():
        hmm.gate.fill_(0.1)  # ... until the gate opens
    hmm.zero_grad()
    (-log_prob(hmm(hidden), x).sum()).backward()
    assert float(hmm.inner.grad.abs().sum()) > 0


def test_logmatvec_gradient_with_zero_weights_matches_linear_space_autograd():
    g = torch.Generator().manual_seed(0)
    w = torch.rand(3, 4, 4, generator=g, dtype=torch.float64)
    w[:, 0, 1:] = 0.0  # exact zeros, as in an identity transition
    w = (w / w.sum(-1, keepdim=True)).requires_grad_()
    v = torch.randn(3, 4, generator=g, dtype=torch.float64).requires_grad_()
    out = _logmatvec(w, v)
    ref_w, ref_v = w.detach().clone().requires_grad_(), v.detach().clone().requires_grad_()
    ref = torch.log((ref_w * ref_v.exp()[:, None, :]).sum(-1))
    assert torch.allclose(out, ref, atol=1e-12)
    weights = torch.randn(3, 4, generator=g, dtype=torch.float64)
    gw, gv = torch.autograd.grad((out * weights).sum(), (w, v))
    rw, rv = torch.autograd.grad((ref * weights).sum(), (ref_w, ref_v))
    assert torch.allclose(gw, rw, atol=1e-12) and torch.allclose(gv, rv, atol=1e-12)


def test_window_loss_is_eq4_with_discount():
    """FF windows: the conditional of offset j is phi_j(x_j), so the loss is computable by hand."""
    labels = torch.tensor([[-100, -100, 3, 4, 5, 6], [-100, 7, 8, -100, 9, 1]])
    targets, valid = window_targets(labels, n=3)
    assert targets.shape == (2, 6, 3)
    assert valid[0, 1].tolist() == [False, True, True] and valid[0, 5].tolist() == [True, False, False]
    assert valid[1, 2].tolist() == [True, False, True]  # a prompt byte inside the window is summed out
    g = torch.Generator().manual_seed(0)
    log_phi = torch.randn(12, 3, 1, V, generator=g, dtype=torch.float64).log_softmax(-1)
    params = CircuitParams("ff", log_phi)
    example = torch.arange(2).repeat_interleave(6)
    gamma = 0.8
    loss, per_offset = window_loss(params, targets.reshape(12, 3), valid.reshape(12, 3), example, 2, gamma)
    lp = log_phi[:, :, 0].gather(-1, targets.reshape(12, 3, 1)).squeeze(-1)  # [W, n]
    vm = valid.reshape(12, 3)
    expect = []
    for j in range(3):
        per_ex = []
        for e in range(2):
            rows = example == e
            per_ex.append(float(-(lp[rows, j] * vm[rows, j]).sum() / vm[rows, j].sum()))
        expect.append(sum(per_ex) / 2)
    assert torch.allclose(per_offset, torch.tensor(expect, dtype=torch.float64))
    total = sum(gamma ** j * expect[j] for j in range(3)) / sum(gamma ** j for j in range(3))
    assert math.isclose(float(loss), total, rel_tol=1e-12)


def trained_looking(arch, n, r, seed=0):
    head = MTPCHead(MTPCConfig(arch=arch, n=n, r=r), lm_head()).double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return head


@pytest.mark.parametrize("arch", ["ff", "cp", "hmm", "btree"])
def test_lazy_decode_units_equal_the_full_head(arch):
    """`MTPCHead.decode` (what speculative sampling uses) draws the same windows from the same
    generator as `sample` on the full head, gives the same conditionals, and computes all r units
    only of the positions it was asked for."""
    n, r = 8, 3
    head = trained_looking(arch, n, r)
    h = torch.randn(D, dtype=torch.float64)
    full = head(h[None])
    for m in (0, 1):
        evidence = observed = None
        if m:
            evidence, observed = windows(1, n, seed=5), torch.arange(n)[None] < m
        params, units = decode_window(head, h)
        units.upto(m)
        g_lazy, g_full = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
        states = sample_states(params, g_lazy, evidence, observed)
        window = sample_tokens(units.selected(states), g_lazy, evidence, observed)
        assert torch.equal(window, sample(full, g_full, evidence, observed))
        if arch != "ff":  # nothing else computed (FF's one unit per position is all its draw reads)
            assert units.ready == m and float(units.log_phi[0, m:].abs().sum()) == 0.0
        for j in range(m, n):
            units.upto(j + 1)
            torch.testing.assert_close(next_log_probs_posterior(params, window, j),
                                       next_log_probs_posterior(full, window, j), rtol=1e-10, atol=1e-10)
        assert units.ready == n
        torch.testing.assert_close(units.log_phi, full.log_phi, rtol=1e-10, atol=1e-10)
    if arch != "btree":  # a shorter window is the marginal of its first positions
        params, units = decode_window(head, h, n=3)
        units.upto(3)
        x = windows(4, 3)
        inner = None if full.inner is None else full.inner[:, :2]
        cut = CircuitParams(arch, full.log_phi[:, :3], full.root, inner)
        torch.testing.assert_close(log_prob(params.index(torch.zeros(4, dtype=torch.long)), x),
                                   log_prob(cut.index(torch.zeros(4, dtype=torch.long)), x))


@pytest.mark.parametrize("n", [2, 8])
def test_lazy_btree_draws_the_same_windows_and_conditionals_as_the_full_head(n):
    """`LazyBTree` (the BTree sampling cycle) draws the same window as `sample` on the full head
    from the same generator, with and without kept bytes, also when only a prefix is drafted;
    its conditionals equal the enumerated ones; and it projects only the weights it reads."""
    r = 3
    head = trained_looking("btree", n, r, seed=4)
    h = torch.randn(D, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    full = head(h[None])
    levels = n.bit_length() - 2  # inner levels: n/2, n/4, ..., 2 nodes
    for m in range(0, min(n, 3)):
        given = windows(1, n, seed=5)[0, :m].tolist()
        evidence = observed = None
        if m:
            evidence, observed = windows(1, n, seed=5), torch.arange(n)[None] < m
        expected = sample(full, torch.Generator().manual_seed(3), evidence, observed)[0]
        for drafted in sorted({n, max(m, 1), (n + m + 1) // 2}):
            tree = LazyBTree(head, h)
            window = tree.sample(torch.Generator().manual_seed(3), given, drafted)
            assert torch.equal(window[:drafted], expected[:drafted]), (m, drafted)
            assert not window[drafted:].any()
        assert tree.ready == m
        if m == 0:
            assert not tree.weights  # drawing read single rows only
        for i in range(m, n):
            got = tree.conditional(i)
            if i == m == 0:  # the first conditional reads the units of one position and its path
                assert tree.ready == 1 and len(tree.weights) == levels
            torch.testing.assert_close(got, next_log_probs(full, window[None], i)[0], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_lazy_btree_in_low_precision_verifies_with_the_rows_it_drew_from(dtype):
    """units=bfloat16|int8: products of other shapes may round differently, so the sum-weight
    rows and input units a draw read are the ones the conditionals use afterwards (sampling exact)."""
    head = trained_looking("btree", 8, 3, seed=2).float()
    h = torch.randn(D, generator=torch.Generator().manual_seed(4))
    tree = LazyBTree(head, h, dtype)
    tree.sample(torch.Generator().manual_seed(1), [], 8)
    levels = {level: (list(rows), logits.copy()) for level, (rows, logits) in tree.drawn.items()}
    units = {p: (unit, row.copy()) for p, (unit, row) in tree.drawn_units.items()}
    assert sum(len(rows) for rows, _ in levels.values()) == 4 + 2  # every inner node drew from one row
    assert sorted(units) == list(range(8))  # and so did every position
    with torch.no_grad():  # the full products now round differently (exaggerated)
        for weight in (tree.inner, tree.unembed):
            (weight.scales.mul_(1.01) if isinstance(weight, Int8Rows) else weight.add_(0.01))
    for i in range(8):
        tree.conditional(i)
    checked = 0
    for level, (rows, logits) in levels.items():
        for k, row in enumerate(rows):
            if (level, k) in tree.weights:
                assert np.array_equal(tree.weights[level, k][row], _np_softmax(logits[k]))
                checked += 1
    assert checked == len(tree.weights) > 0
    for position, (unit, row) in units.items():
        assert np.array_equal(tree.leaves[position, unit], row)


@pytest.mark.parametrize("K", [8, 24, 64])
def test_int8_rows_quantize_rows_and_keep_their_scales_through_indexing(K):
    """units=int8: one scale per row, every weight within half a step of its row's grid; the
    products (torch's kernel at K = 64, the dequantizing fallback at row lengths the kernel
    reads past: it gave garbage at K = 8 and 24) equal the dequantized weights' (bfloat16
    rounding aside), also on indexed and `index_select`-gathered blocks."""
    from mtpkit.models.mtpc.decode import _blocks_matvec, _matvec

    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 4, 5, K, generator=g) * torch.rand(3, 4, 5, 1, generator=g)  # rows of unequal range
    q = Int8Rows.quantize(w)
    assert q.q.dtype == torch.int8 and q.scales.shape == (3, 4, 5)
    step = q.scales.float()[..., None]
    assert ((q.dequantize() - w).abs() <= step * (0.5 + 1e-5)).all()
    assert q.q.abs().amax(-1).ge(126).all()  # each row uses its grid's range
    x = torch.randn(K, generator=g).bfloat16()
    want = q.dequantize() @ x.float()
    torch.testing.assert_close(_matvec(q, x).float(), want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(_matvec(q[1, 2], x).float(), want[1, 2], rtol=2e-2, atol=2e-2)
    i, j = torch.tensor([2, 0, 1]), torch.tensor([3, 3, 0])
    blocks = _blocks_matvec(q, i, j, x)
    assert torch.equal(blocks, torch.stack([_matvec(q[a, b], x) for a, b in zip(i.tolist(), j.tolist())]))
    assert not torch.equal(blocks, _blocks_matvec(q, i, (j + 1) % 4, x))  # the index reaches the rows


def test_decode_copies_of_several_precisions_coexist():
    """Drafters of several precisions may share one head (a bench): each precision is converted
    once, not again every time the other one is used; a weight update converts again."""
    head = trained_looking("btree", 4, 3, seed=1).float()
    first = {dtype: weight_as(head, "unembed", dtype) for dtype in (torch.bfloat16, torch.int8)}
    for dtype in (torch.bfloat16, torch.int8, torch.bfloat16):
        assert weight_as(head, "unembed", dtype) is first[dtype]
    with torch.no_grad():
        head.unembed.add_(1.0)
    assert weight_as(head, "unembed", torch.int8) is not first[torch.int8]
