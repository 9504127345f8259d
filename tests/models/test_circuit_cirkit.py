"""native == cirkit: the same CircuitParams through cirkit's compiled circuits and queries."""

import pytest
import torch

from mtpkit.models.mtpc.circuit_cirkit import CirkitCircuit
from mtpkit.models.mtpc.circuits import ARCHS, log_prob, prefix_log_probs

from test_circuits import all_windows, brute_joint, random_params, tv_of_samples


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("n,r,V", [(4, 2, 3), (8, 3, 5)])
def test_cirkit_log_likelihoods_and_marginals_equal_native(arch, n, r, V):
    p = random_params(arch, B=6, n=n, r=r, V=V, seed=n)
    circuit = CirkitCircuit(arch, n, r, V)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, V, (6, n), generator=g)
    observed = torch.rand(6, n, generator=g) < 0.6
    assert torch.allclose(circuit.log_prob(p, x), log_prob(p, x), atol=1e-12, rtol=0)
    assert torch.allclose(circuit.log_marginal(p, x, observed), log_prob(p, x, observed), atol=1e-12, rtol=0)
    assert torch.allclose(circuit.prefix_log_probs(p, x), prefix_log_probs(p, x), atol=1e-12, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_cirkit_sampling_matches_brute_force(arch):
    p = random_params(arch, B=1, seed=5, sharpness=3.0)
    circuit = CirkitCircuit(arch, 4, 2, 3)
    torch.manual_seed(0)  # cirkit's sampler draws from the global generator
    draws = circuit.sample(p, num_samples=20000)[:, 0]
    assert tv_of_samples(p, draws) < 0.04
    # and the brute-force total is 1 through cirkit too
    windows = torch.tensor(all_windows())
    total = circuit.log_prob(p.index(torch.zeros(len(windows), dtype=torch.long)), windows).exp().sum()
    assert abs(float(total) - 1) < 1e-10
    assert abs(brute_joint(p, 0, [0, 1, 2, 0]) - float(circuit.log_prob(p, torch.tensor([[0, 1, 2, 0]])).exp())) < 1e-12
