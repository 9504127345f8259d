"""Any cirkit circuit as an MTPC head: normalised, its queries equal brute-force enumeration,
FF at init, trainable, and refused with a clear error when it cannot be a head."""

import itertools

import pytest
import torch
from cirkit.symbolic.circuit import Circuit
from cirkit.symbolic.layers import CategoricalLayer, HadamardLayer, SumLayer
from cirkit.utils.scope import Scope

from chisquare import chi2_pvalue
from mtpkit.models.mtpc.circuits import greedy_chain, log_prob, mode, next_log_probs, prefix_log_probs, sample
from mtpkit.models.mtpc.cirkit_head import CirkitHead, build_circuit
from mtpkit.models.mtpc import window_loss

V, D, N = 5, 6, 4


def lm_head():
    return torch.randn(V, D, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def trained_looking(name, n=N, r=2, seed=0, scale=1.0):
    head = CirkitHead(build_circuit(name, n, r, V), n, lm_head()).double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return head


def all_windows(n=N):
    return torch.tensor(list(itertools.product(range(V), repeat=n)))


@pytest.mark.parametrize("name", ["random-binary-tree", "linear-tree"])
def test_cirkit_head_queries_equal_brute_force(name):
    head = trained_looking(name)
    params = head(torch.randn(2, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1)))
    X = all_windows()
    joint = torch.stack([log_prob(params.index(torch.full((len(X),), b)), X) for b in range(2)])  # [2, V^N]
    torch.testing.assert_close(joint.logsumexp(-1), torch.zeros(2, dtype=torch.float64), atol=1e-10, rtol=0)
    p = joint.exp().view(2, *[V] * N)
    x = X[[7, 400]]  # one window per example
    prefixes = prefix_log_probs(params, x)
    for b in range(2):
        for i in range(N):
            brute = p[b][tuple(x[b, : i + 1].tolist())].sum().log()
            torch.testing.assert_close(prefixes[b, i], brute, atol=1e-10, rtol=0)
    cond = next_log_probs(params, x, 2)  # q(X_3 | x_1, x_2)
    assert cond.requires_grad  # the KL-to-target loss trains through the conditionals
    for b in range(2):
        marg = p[b][tuple(x[b, :2].tolist())].sum(dim=-1)  # [V] over X_3
        torch.testing.assert_close(cond[b], (marg / marg.sum()).log(), atol=1e-10, rtol=0)
    # greedy: the argmax of each conditional in turn; the evidence is kept
    chain = greedy_chain(params)
    assert torch.equal(mode(params), chain)
    for b in range(2):
        for i in range(N):
            marg = p[b][tuple(chain[b, :i].tolist())]
            marg = marg.sum(dim=tuple(range(1, N - i))) if i < N - 1 else marg  # [V] over X_i
            assert int(chain[b, i]) == int(marg.argmax())
    observed = torch.tensor([[True, False, False, False]] * 2)
    assert torch.equal(greedy_chain(params, x, observed)[:, 0], x[:, 0])


def test_cirkit_head_is_ff_at_init_and_trains():
    head = CirkitHead(build_circuit("random-binary-tree", N, 3, V), N, lm_head()).double()
    hidden = torch.randn(3, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x = all_windows()[[1, 50, 300]]
    ff = (hidden @ lm_head().float().double().T).log_softmax(-1)  # [3, V]: every unit is the (fp32) LM head
    torch.testing.assert_close(log_prob(head(hidden), x), ff.gather(1, x).sum(1), atol=1e-10, rtol=0)
    valid = torch.ones(3, N, dtype=torch.bool)
    opt = torch.optim.Adam(head.parameters(), lr=0.05)
    losses = []
    for _ in range(15):
        loss, _ = window_loss(head(hidden), x, valid, torch.arange(3), 3, 0.9)
        opt.zero_grad()
        loss.backward()
        assert all(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in head.parameters())
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.5 * losses[0]


def test_cirkit_head_samples_follow_the_circuit():
    head = trained_looking("random-binary-tree", n=2, r=3, seed=3, scale=4.0)  # strongly dependent
    params = head(torch.randn(1, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1)))
    X = all_windows(2)
    exact = log_prob(params.index(torch.zeros(len(X), dtype=torch.long)), X).exp().view(V, V)
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(V, V, dtype=torch.long)
    for _ in range(1000):
        a, b = sample(params, g)[0].tolist()
        counts[a, b] += 1
    assert chi2_pvalue(counts, exact) > 1e-3
    wrong = exact.sum(1, keepdim=True) * exact.sum(0, keepdim=True)  # independent marginals
    assert chi2_pvalue(counts, wrong) < 1e-3  # the test can tell the joint from its marginals


def _bad_circuits():
    def circuit(n_vars, categories, units_out=1):
        inputs = [CategoricalLayer(Scope([i]), 2, num_categories=categories) for i in range(n_vars)]
        prod = HadamardLayer(2, arity=n_vars)
        out = SumLayer(2, units_out, arity=1)
        return Circuit(inputs + [prod, out], {prod: inputs, out: [prod]}, [out])

    return [(circuit(N, V + 1), "categories"), (circuit(N - 1, V), "variables"), (circuit(N, V, 2), "one output")]


@pytest.mark.parametrize("case", range(3))
def test_cirkit_head_refuses_circuits_that_are_not_heads(case):
    circuit, words = _bad_circuits()[case]
    with pytest.raises(ValueError, match=words):
        CirkitHead(circuit, N, lm_head())


def test_circuit_names():
    assert isinstance(build_circuit("mtpkit.models.mtpc.cirkit_head:linear_tree", N, 2, V), Circuit)
    with pytest.raises(ValueError, match="--circuit 'nope'"):
        build_circuit("nope", N, 2, V)
    with pytest.raises(ValueError, match="cannot import"):
        build_circuit("mtpkit.models.mtpc.cirkit_head:missing", N, 2, V)
