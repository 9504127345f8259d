"""Gated-LoRA linear and quadratic decoding through the shared decoder: token-identical to AR."""

import copy
import random

import pytest
import torch

from mtpkit.models.decoding.decoder import Target, decode
from mtpkit.models.decoding.drafter import Drafter
from mtpkit.models.gated_lora.drafter import GatedLoRADraftConfig, GatedLoRADrafter
from tests.models.test_gated_lora import make_gated

CONFIGS = [(d, s, k) for d in ("linear", "quadratic") for s in (False, True) for k in (0, 1, 2)]


@pytest.fixture(scope="module")
def gated(tiny):
    return make_gated(tiny[0], k=3, rank=4, seed=5)


@pytest.mark.parametrize("decoding,sampler,k", CONFIGS)
def test_greedy_equals_ar(tiny, gated, decoding, sampler, k):
    base, _ = tiny
    ar_target = Target(base)
    drafter = GatedLoRADrafter(GatedLoRADraftConfig(decoding=decoding, sampler=sampler, k=k), model=gated)
    target = Target(*drafter.adapt(None, {}))
    for seed in range(2):
        prompt = torch.randint(5, 400, (6 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        want = decode(ar_target, Drafter(), prompt, 24).tokens
        got = decode(target, drafter, prompt, 24)
        assert got.tokens == want
        assert got.draft_nodes > 0  # the masks did speculate
        # the random head's speculations are almost never accepted, and only accepted drafts
        # test verification (their rows must be scored with the gate off): the same drafter, its
        # speculations replaced by the AR continuation (corrupted at a random depth), must accept
        oracle = OracleGated(want, GatedLoRADraftConfig(decoding=decoding, sampler=sampler, k=k), gated, seed)
        got = decode(target, oracle, prompt, 24)
        assert got.tokens == want
        assert sum(got.accept_counts) > 0, "no speculation accepted: verification was not exercised"


class OracleGated(GatedLoRADrafter):
    """Replaces the speculated tokens by the true continuation (corrupted at a seeded random
    depth) whenever the real drafter speculates, so full and partial acceptances both happen
    while the block bookkeeping (which masks follow the deepest accepted node) stays real."""

    def __init__(self, truth, config, model, seed=0):
        super().__init__(config, model)
        # Python's random, not a torch generator: tests/eval/test_host_syncs.py counts tensor reads
        self.truth, self.rng = truth, random.Random(seed)

    def begin(self, target, prompt_ids):
        super().begin(target, prompt_ids)
        self.start = len(prompt_ids)

    def propose(self, tokens):
        if self.spec:
            done = len(tokens) - self.start
            spec = self.truth[done: done + len(self.spec)]
            wrong = self.rng.randrange(2 * len(spec) + 1)
            if wrong < len(spec):
                spec[wrong] = (spec[wrong] + 1) % 400
            self.spec = spec
        return super().propose(tokens)


@pytest.mark.parametrize("decoding", ["linear", "quadratic"])
def test_acceptance_paths_with_an_oracle(tiny, gated, decoding):
    base, _ = tiny
    prompt = list(range(10, 18))
    truth = decode(Target(base), Drafter(), prompt, 80).tokens
    drafter = OracleGated(truth, GatedLoRADraftConfig(decoding=decoding, sampler=False), gated, seed=1)
    target = Target(*drafter.adapt(None, {}))
    got = decode(target, drafter, prompt, 80)
    assert got.tokens == truth
    assert got.tau > 1.5 and len(got.accept_counts) == 3  # long acceptances happened
    assert got.accept_counts[0] < got.target_calls - 1     # and rejections too
    if decoding == "quadratic":
        # every step after the first carries k speculations: k fresh ones follow any acceptance
        assert got.draft_nodes == 3 * (got.target_calls - 1)
    else:
        assert got.draft_nodes < 3 * (got.target_calls - 1)  # a partial acceptance leaves none


def test_sampler_auto_follows_the_head(tiny, gated):
    """sampler unset (-1): the sampler head speculates when the head has one, the base head when it
    was trained without one (--sampler 0); sampler=1 on such a head is refused by name."""
    base, _ = tiny
    bare = make_gated(base, k=3, rank=4, seed=5, sampler=False)
    assert GatedLoRADrafter(GatedLoRADraftConfig(), model=gated).use_sampler
    assert not GatedLoRADrafter(GatedLoRADraftConfig(), model=bare).use_sampler
    assert not GatedLoRADrafter(GatedLoRADraftConfig(sampler=0), model=gated).use_sampler
    with pytest.raises(ValueError, match="has no sampler head"):
        GatedLoRADrafter(GatedLoRADraftConfig(sampler=1), model=bare)
    with pytest.raises(ValueError, match="sampler must be"):
        GatedLoRADrafter(GatedLoRADraftConfig(sampler=2), model=gated)
    prompt = list(range(10, 18))
    auto = GatedLoRADrafter(GatedLoRADraftConfig(), model=bare)
    target = Target(*auto.adapt(None, {}))
    got = decode(target, auto, prompt, 24)
    explicit = decode(target, GatedLoRADrafter(GatedLoRADraftConfig(sampler=0), model=bare), prompt, 24)
    assert got.tokens == explicit.tokens == decode(Target(base), Drafter(), prompt, 24).tokens
    assert got.draft_nodes == explicit.draft_nodes > 0 and got.accept_counts == explicit.accept_counts


def test_bad_options_are_clear(gated):
    with pytest.raises(ValueError, match="decoding"):
        GatedLoRADrafter(GatedLoRADraftConfig(decoding="cubic"), model=gated)
    with pytest.raises(ValueError, match="drafts must be one of"):
        GatedLoRADrafter(GatedLoRADraftConfig(drafts="beam"), model=gated)
    with pytest.raises(ValueError, match="head=DIR"):
        GatedLoRADrafter(GatedLoRADraftConfig())
    with pytest.raises(ValueError, match="trained with k=3"):  # refused when built, before any decode
        GatedLoRADrafter(GatedLoRADraftConfig(k=5), model=gated)


@torch.no_grad()
def test_inference_form_matches_the_peft_form(tiny, tmp_path):
    from mtpkit.data.mtp import collate_mask_inputs, mask_inputs
    from mtpkit.models.gated_lora import GatedLoRALinear, load_head, save_head, to_inference
    base, _ = tiny
    trained = make_gated(base, k=3, rank=4, seed=7)
    save_head(trained, tmp_path, "tiny-llama-random")
    lean = to_inference(load_head(tmp_path, copy.deepcopy(base)))
    assert sum(isinstance(m, GatedLoRALinear) for m in lean.modules()) == 2 * 7
    ids = torch.arange(30, 44)
    labels = torch.cat([torch.full((5,), -100), ids[5:]])
    batch = collate_mask_inputs([mask_inputs(ids, labels, 3)])
    args = (batch["input_ids"], batch["mask_index"], batch["position_ids"], batch["attention_mask"])
    a, b = trained.hidden_states(*args), lean.hidden_states(*args)  # scattered gate rows: the general path
    ntp = batch["mask_index"] == 0
    assert torch.equal(a[ntp], b[ntp])
    assert torch.allclose(a, b, atol=1e-5)
    # decoding (a contiguous gated suffix): same tokens as AR, and the same speculations as the peft form
    prompt = list(range(50, 58))
    for decoding in ("linear", "quadratic"):
        outs, oracles = [], []
        want = decode(Target(base), Drafter(), prompt, 20).tokens
        for model in (trained, lean):
            drafter = GatedLoRADrafter(GatedLoRADraftConfig(decoding=decoding), model=model)
            outs.append(decode(Target(*drafter.adapt(None, {})), drafter, prompt, 20))
            oracle = OracleGated(want, GatedLoRADraftConfig(decoding=decoding), model, seed=3)  # accepts drafts
            oracles.append(decode(Target(*oracle.adapt(None, {})), oracle, prompt, 20))
        assert outs[0].tokens == outs[1].tokens == want
        assert outs[0].accept_counts == outs[1].accept_counts
        assert oracles[0].tokens == oracles[1].tokens == want
        assert oracles[0].accept_counts == oracles[1].accept_counts and sum(oracles[0].accept_counts) > 0
