"""Speculative sampling on the device path (`Target.cpu_paths` off, as on a GPU; run here on a CPU):
`sample_on_device` draws, accepts and picks the bonus without a host read, and the output follows
the target's distribution exactly, for chains of drawn drafts, deterministic chains and
deterministic trees whose siblings share a token; a tree of drawn drafts still walks on the host
and stays exact. Each check has power: a planted wrong rule fails it."""

import pytest
import torch

import mtpkit.models.decoding.decoder as decoder_module
from mtpkit.models.decoding.decoder import Target, decode
from mtpkit.models.decoding.drafter import Draft, Drafter
from mtpkit.models.decoding.host_reads import counting_reads
from mtpkit.models.decoding.verify import accept_on_device, draw
from mtpkit.models.probe import ProbeConfig, ProbeDrafter
from tests.eval.test_decoder import (PROMPT, Q, FixedChainDrafter, SampledChainDrafter, SampledTreeDrafter,
                                     _sampling_matches, small_vocab_model)  # noqa: F401 (a fixture)


@pytest.fixture(scope="module")
def device_target(small_vocab_model):
    target = Target(small_vocab_model)
    target.cpu_paths = False  # the device path, on this CPU
    return target


class TwinTreeDrafter(Drafter):
    """A deterministic tree whose two root children hold the same token (0, the target's likeliest
    first token), each with a child of its own (tokens 3 and 0, about 0.2 likely after a 0): the
    second twin must never be taken, or the draws under both twins race and the second token
    leans towards the second twin's child (0 about 0.29 likely instead of 0.18)."""

    def __init__(self):
        self.accepted = []

    def propose(self, tokens):
        return Draft(tokens=[0, 0, 3, 0], parents=[0, 0, 1, 2])

    def observe(self, step):
        self.accepted.append(list(step.accepted))


DRAFTERS = {
    "drawn chain": lambda: SampledChainDrafter(Q, seed=1),
    "deterministic chain": lambda: FixedChainDrafter([0, 1]),
    "deterministic tree": TwinTreeDrafter,
    "drawn tree (host walk)": lambda: SampledTreeDrafter(Q, fixed=3, seed=4),
}


# the twin tree's bias (about +0.1 on one of 25 cells of the joint) needs 2000 decodes to be seen;
# with 600 each planted bug of the others fails at p < 1e-10 (the bonus drawn from p or, for
# deterministic drafts, drawn again; acceptance with p(x) instead of min(1, p/q); a tree's
# sibling tested against p instead of the residual; the temperature left out at T = 0.7)
RUNS = {"drawn chain": 600, "deterministic chain": 600, "deterministic tree": 2000, "drawn tree (host walk)": 600}


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("name", list(DRAFTERS))
def test_sampling_on_the_device_is_exact(device_target, name, temperature):
    assert _sampling_matches(device_target, DRAFTERS[name](), runs=RUNS[name], temperature=temperature), \
        f"sampling on the device path with a {name} is not distributed as the target"


def test_the_twin_tree_accepts_at_depth_two_and_only_under_the_first_twin(device_target):
    drafter = TwinTreeDrafter()
    decode(device_target, drafter, PROMPT, 200, temperature=1.0, generator=torch.Generator().manual_seed(0))
    paths = drafter.accepted
    assert any(p == [1, 3] for p in paths) and not any(2 in p for p in paths), paths


def _racing_twins(choices, step_tokens, layout=None):
    """A WRONG rule: every sibling holding its parent's draw counts (no first-twin rule)."""
    if layout is None:
        return accept_on_device(choices, step_tokens)
    n = step_tokens.shape[0]
    allowed, depth = layout[0][:n, :n], layout[1][:n]
    parent = (allowed & (depth[None, :] == depth[:, None] - 1)).long().argmax(-1)
    holds = (step_tokens == choices[parent]) | (depth == 0)
    return (depth * ~(allowed & ~holds[None, :]).any(-1)).argmax()


def _bonus_from_the_target(probs, step_tokens, draft_probs, layout=None, generator=None):
    """A WRONG rule: Leviathan's acceptance, but the bonus drawn from p instead of the residual."""
    n = step_tokens.shape[0]
    p, q = probs[:n], draft_probs[: n - 1].to(probs)
    x = step_tokens[1:, None]
    px, qx = p[:-1].gather(1, x)[:, 0], q.gather(1, x)[:, 0]
    u = torch.rand(n - 1, generator=generator)
    last = ((qx > 0) & (u * qx < px)).long().cumprod(0).sum()
    return torch.stack([last, draw(p, generator)[last]])


def test_the_checks_catch_wrong_device_rules(device_target, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr("mtpkit.models.decoding.verify.accept_on_device", _racing_twins)
        assert not _sampling_matches(device_target, TwinTreeDrafter(), runs=RUNS["deterministic tree"]), \
            "the check misses twins racing"
    with monkeypatch.context() as m:
        m.setattr(decoder_module, "sample_on_device", _bonus_from_the_target)
        assert not _sampling_matches(device_target, SampledChainDrafter(Q, seed=3), runs=RUNS["drawn chain"]), \
            "the check misses a bonus drawn from the target"


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_a_sampled_step_reads_the_host_once(tiny, temperature):
    """AR and the probe (deterministic trees) sample with one read of the decision a step, plus
    the probe's own top-k read; the next input is a view of the device's bonus (no upload)."""
    prompt = list(range(10, 30))
    for drafter, bound in ((Drafter(), 1), (ProbeDrafter(ProbeConfig(bc=10)), 2)):
        target = Target(tiny[0])
        target.cpu_paths = False
        with counting_reads(drafter, target) as steps:
            result = decode(target, drafter, prompt, 30, temperature=temperature,
                            generator=torch.Generator().manual_seed(0))
        assert result.target_calls == len(steps) and max(steps) <= bound, (type(drafter).__name__, steps)
        if bound == 1:
            assert max(steps.uploads) == 0, steps.uploads
