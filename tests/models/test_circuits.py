"""The native circuit queries against brute-force enumeration over all V^n windows.

The reference below is written independently of models/mtpc/circuits.py: plain Python recursion
over the latent variables of each structure, one window at a time.
"""

import itertools
import math

import pytest
import torch

from mtpkit.models.mtpc.circuits import (ARCHS, CircuitParams, greedy_chain, log_prob, mode, next_log_probs,
                                    next_log_probs_posterior, num_inner, prefix_log_probs, sample)

V, N, R = 3, 4, 2


def random_params(arch, B=2, n=N, r=R, V=V, seed=0, sharpness=2.0) -> CircuitParams:
    g = torch.Generator().manual_seed(seed)
    r = 1 if arch == "ff" else r
    log_phi = (torch.randn(B, n, r, V, generator=g, dtype=torch.float64) * sharpness).log_softmax(-1)
    root = (torch.randn(B, r, generator=g, dtype=torch.float64) * sharpness).softmax(-1) if arch != "ff" else None
    L = num_inner(arch, n)
    inner = (torch.randn(B, L, r, r, generator=g, dtype=torch.float64) * sharpness).softmax(-1) if L else None
    return CircuitParams(arch, log_phi, root, inner)


def brute_joint(p: CircuitParams, b: int, x, latent_max=False):
    """q(x) of example b by recursion over the latent variables (sum, or max with latent_max)."""
    phi = p.log_phi[b].exp()
    agg = max if latent_max else sum
    n, r = p.n, p.r
    if p.arch == "ff":
        return math.prod(float(phi[i, 0, x[i]]) for i in range(n))
    root = p.root[b]
    if p.arch == "cp":
        return agg(float(root[z]) * math.prod(float(phi[i, z, x[i]]) for i in range(n)) for z in range(r))
    inner = p.inner[b]
    if p.arch == "hmm":
        def rest(i, z):  # q(x_i.. | z_i = z)
            here = float(phi[i, z, x[i]])
            if i == n - 1:
                return here
            return here * agg(float(inner[i, z, z2]) * rest(i + 1, z2) for z2 in range(r))
        return agg(float(root[z]) * rest(0, z) for z in range(r))
    # btree: node ids level by level, bottom-up, left to right
    levels, start, nodes = [], 0, n // 2
    while nodes > 1:
        levels.append((start, nodes))
        start, nodes = start + nodes, nodes // 2

    def value(level, k, unit):  # a child of a node that chose `unit`: level -1 = leaf k
        if level < 0:
            return float(phi[k, unit, x[k]])
        node = levels[level][0] + k
        return agg(float(inner[node, unit, i]) * value(level - 1, 2 * k, i) * value(level - 1, 2 * k + 1, i)
                   for i in range(r))
    top = len(levels) - 1
    return agg(float(root[i]) * value(top, 0, i) * value(top, 1, i) for i in range(r))


def all_windows(n=N, V=V):
    return [list(w) for w in itertools.product(range(V), repeat=n)]


@pytest.mark.parametrize("arch", ARCHS)
def test_normalised_and_log_prob_matches_brute_force(arch):
    p = random_params(arch)
    windows = all_windows()
    x = torch.tensor(windows)
    for b in range(2):
        pb = p.index(torch.full((len(windows),), b))
        ours = log_prob(pb, x).exp()
        ref = torch.tensor([brute_joint(p, b, w) for w in windows], dtype=torch.float64)
        assert torch.allclose(ours, ref, atol=1e-12)
        assert abs(float(ours.sum()) - 1.0) < 1e-10


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_marginals_and_conditionals(arch):
    p = random_params(arch, seed=1)
    windows = all_windows()
    joint = {tuple(w): brute_joint(p, 0, w) for w in windows}
    x = torch.tensor([[2, 0, 1, 1], [1, 1, 0, 2]])
    p0 = p.index(torch.tensor([0, 0]))
    ours = prefix_log_probs(p0, x).exp()
    for row in range(2):
        for i in range(N):
            ref = sum(v for w, v in joint.items() if list(w[: i + 1]) == x[row, : i + 1].tolist())
            assert abs(float(ours[row, i]) - ref) < 1e-12
    # the same through log_prob with an observed mask, which also marginalises a middle position
    observed = torch.tensor([[True, False, True, False], [False, True, True, True]])
    masked = log_prob(p0, x, observed).exp()
    for row in range(2):
        ref = sum(v for w, v in joint.items()
                  if all(w[i] == x[row, i] for i in range(N) if observed[row, i]))
        assert abs(float(masked[row]) - ref) < 1e-12
    # conditional of position 2 given the first two tokens
    cond = next_log_probs(p0, x, 2).exp()
    for row in range(2):
        pre = x[row, :2].tolist()
        marg = [sum(v for w, v in joint.items() if list(w[:3]) == pre + [c]) for c in range(V)]
        ref = torch.tensor(marg, dtype=torch.float64) / sum(marg)
        assert torch.allclose(cond[row], ref, atol=1e-12)


@pytest.mark.parametrize("arch", ARCHS)
def test_mode_is_the_max_product_window(arch):
    p = random_params(arch, seed=2, sharpness=3.0)
    got = mode(p)
    for b in range(2):
        scores = {tuple(w): brute_joint(p, b, w, latent_max=True) for w in all_windows()}
        best = max(scores.values())
        assert math.isclose(scores[tuple(got[b].tolist())], best, rel_tol=1e-9), arch
        if arch in ("ff", "cp", "hmm") and p.r == 1 or arch == "ff":
            exact = {tuple(w): brute_joint(p, b, w) for w in all_windows()}
            assert got[b].tolist() == list(max(exact, key=exact.get))


def tv_of_samples(p: CircuitParams, draws: torch.Tensor) -> float:
    counts = {}
    for w in draws.tolist():
        counts[tuple(w)] = counts.get(tuple(w), 0) + 1
    n = len(draws)
    return 0.5 * sum(abs(counts.get(tuple(w), 0) / n - brute_joint(p, 0, w)) for w in all_windows())


def independent_marginals(p: CircuitParams) -> torch.Tensor:
    """[n, V] per-position marginals of example 0 (what an independence assumption keeps)."""
    windows = torch.tensor(all_windows())
    probs = log_prob(p.index(torch.zeros(len(windows), dtype=torch.long)), windows).exp()
    return torch.stack([torch.zeros(V, dtype=torch.float64).index_add(0, windows[:, i], probs) for i in range(N)])


@pytest.mark.parametrize("arch", ARCHS)
def test_sampler_matches_the_distribution_and_a_wrong_sampler_fails(arch):
    """20k draws: the total-variation distance to the exact distribution is below 0.04 (its
    expected value here is ~0.02). The negative control samples every position from its own
    marginal (what an independence assumption does) on a circuit whose exact distance to that
    product is > 0.15: the same check must reject it."""
    draws, g = 20000, torch.Generator().manual_seed(0)
    for seed in range(3, 100):
        p = random_params(arch, B=1, seed=seed, sharpness=3.0)
        marginals = independent_marginals(p)
        exact_tv = 0.5 * sum(abs(brute_joint(p, 0, w) - math.prod(float(marginals[i, w[i]]) for i in range(N)))
                             for w in all_windows())
        if arch == "ff" or exact_tv > 0.15:
            break
    else:
        pytest.fail(f"no {arch} circuit far from independence among 97 seeds")
    rows = torch.zeros(draws, dtype=torch.long)
    tv = tv_of_samples(p, sample(p.index(rows), generator=g))
    assert tv < 0.04, tv
    if arch != "ff":
        wrong = torch.stack([torch.multinomial(marginals[i], draws, replacement=True, generator=g)
                             for i in range(N)], 1)
        assert tv_of_samples(p, wrong) > 0.08


@pytest.mark.parametrize("arch", ARCHS)
def test_sampling_and_mode_given_evidence(arch):
    """q(rest | x_0 = a, x_2 = b) by conditional ancestral sampling matches the brute-force
    conditional; the conditional mode is the best max-product window that agrees with them."""
    p = random_params(arch, B=1, seed=7, sharpness=3.0)
    evidence = torch.tensor([[2, 0, 1, 0]])
    observed = torch.tensor([[True, False, True, False]])
    joint = {tuple(w): brute_joint(p, 0, w) for w in all_windows()}
    consistent = {w: v for w, v in joint.items() if w[0] == 2 and w[2] == 1}
    total = sum(consistent.values())
    draws = 20000
    rows = torch.zeros(draws, dtype=torch.long)
    got = sample(p.index(rows), torch.Generator().manual_seed(0), evidence.expand(draws, -1),
                 observed.expand(draws, -1))
    assert (got[:, 0] == 2).all() and (got[:, 2] == 1).all()
    counts = {}
    for w in got.tolist():
        counts[tuple(w)] = counts.get(tuple(w), 0) + 1
    tv = 0.5 * sum(abs(counts.get(w, 0) / draws - v / total) for w, v in consistent.items())
    assert tv < 0.04, tv
    best = mode(p, evidence, observed)[0].tolist()
    scores = {w: brute_joint(p, 0, list(w), latent_max=True) for w in consistent}
    assert best[0] == 2 and best[2] == 1
    assert math.isclose(scores[tuple(best)], max(scores.values()), rel_tol=1e-9)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_chain_takes_each_conditional_argmax(arch):
    p = random_params(arch, B=1, seed=8)
    joint = {tuple(w): brute_joint(p, 0, w) for w in all_windows()}
    got = greedy_chain(p)[0].tolist()
    for i in range(N):
        cond = [sum(v for w, v in joint.items() if list(w[:i]) == got[:i] and w[i] == c) for c in range(V)]
        assert got[i] == max(range(V), key=cond.__getitem__)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("n", [4, 8])
def test_posterior_conditionals_equal_the_enumerated_ones(arch, n):
    p = random_params(arch, B=3, n=n, r=3, V=5, seed=n)
    x = torch.randint(0, 5, (3, n), generator=torch.Generator().manual_seed(0))
    for i in range(n):
        assert torch.allclose(next_log_probs_posterior(p, x, i), next_log_probs(p, x, i), atol=1e-10)
