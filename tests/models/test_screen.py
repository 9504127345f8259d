"""The bf16 screen of a large LM head (`ScreenedHead`): the float32 top k, near-ties included, and
the gated-LoRA sampler's speculations unchanged by it."""

import pytest
import torch
from torch import nn

import mtpkit.models.screen as screen
from mtpkit.models.decoding.decoder import Target, decode
from mtpkit.models.decoding.drafter import Drafter
from mtpkit.models.gated_lora.drafter import GatedLoRADraftConfig, GatedLoRADrafter
from mtpkit.models.screen import ScreenedHead
from mtpkit.models.packed_linear import onednn_available, packable_dtypes
from tests.models.test_gated_lora import make_gated

pytestmark = pytest.mark.skipif(not onednn_available() or torch.bfloat16 not in packable_dtypes(),
                                reason="the screen runs oneDNN's bf16 product")


def near_tie_head(V=4096, d=64, seed=0) -> nn.Linear:
    """An LM head whose rows come in pairs closer than bf16 can tell apart: the screen alone
    ranks each pair at random, so only the float32 recomputation gets the order right."""
    gen = torch.Generator().manual_seed(seed)
    head = nn.Linear(d, V, bias=False)
    with torch.no_grad():
        base = torch.randn(V // 2, d, generator=gen)
        head.weight.copy_(torch.cat([base, base + 1e-4 * torch.randn(V // 2, d, generator=gen)]))
    return head


@torch.no_grad()
def test_screen_gives_the_float32_top_k():
    head = near_tie_head()
    assert ScreenedHead.usable(head, min_numel=0) and not ScreenedHead.usable(head)  # below MIN_SCREEN
    sc = ScreenedHead(head)
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(64, 64, generator=gen) * 3
    for k in (1, 5):
        want = head(h).topk(k, dim=-1).indices
        assert torch.equal(sc.topk(h, k), want)
        assert torch.equal(sc.topk(h[0], k), want[0])  # one row [d] -> [k]
    # the pairs are within bf16 rounding: the bf16 product alone gets some of their order wrong
    low = (h.bfloat16() @ head.weight.bfloat16().t()).float()
    assert not torch.equal(low.argmax(-1), head(h).argmax(-1))
    # a near-flat row (many candidates) takes the full product, still the float32 top k
    assert torch.equal(sc.topk(torch.zeros(64) + 1e-3, 3), head(torch.zeros(64) + 1e-3).topk(3).indices)
    # a weight changed in place is screened again
    head.weight.mul_(-1.0)
    assert torch.equal(sc.topk(h, 1), head(h).topk(1, dim=-1).indices)


@torch.no_grad()
@pytest.mark.parametrize("decoding", ["linear", "quadratic"])
def test_screened_sampler_drafts_as_the_float32_one(tiny, monkeypatch, decoding):
    """The tiny model's LM head is screened (MIN_SCREEN lowered): greedy output is AR's and the
    sampler's speculations are the unscreened drafter's, step for step."""
    base, _ = tiny
    gated = make_gated(base, k=3, rank=4, seed=5)
    prompt = list(range(10, 18))
    want = decode(Target(base), Drafter(), prompt, 32).tokens
    runs = {}
    for screened in (False, True):
        monkeypatch.setattr(screen, "MIN_SCREEN", 0 if screened else 1 << 60)
        drafter = GatedLoRADrafter(GatedLoRADraftConfig(decoding=decoding, sampler=1), model=gated)
        target = Target(*drafter.adapt(None, {}))
        drafts, observe = [], drafter.observe

        def record(step, observe=observe, drafts=drafts, drafter=drafter):
            observe(step)
            drafts.append(list(drafter.spec))
        drafter.observe = record
        got = decode(target, drafter, prompt, 32)
        assert got.tokens == want
        assert (drafter.screen is not None) == screened
        runs[screened] = drafts
    assert runs[True] == runs[False] and any(runs[True])


@torch.no_grad()
@pytest.mark.parametrize("arch", ["medusa", "hydra"])
def test_screened_heads_draft_as_the_float32_ones(tiny, monkeypatch, arch):
    """Medusa's and Hydra's tree drafts through the screened LM head (MIN_SCREEN lowered): greedy
    output is AR's, and every step's draft tokens are the unscreened drafter's."""
    from mtpkit.models.medusa import MedusaConfig, MedusaDraftConfig, MedusaDrafter, MedusaHeads

    base, _ = tiny
    torch.manual_seed(3)
    heads = MedusaHeads(base, MedusaConfig(arch=arch, heads=3, layers=1)).eval()
    prompt = list(range(10, 18))
    want = decode(Target(base), Drafter(), prompt, 24).tokens
    runs = {}
    for screened in (False, True):
        monkeypatch.setattr(screen, "MIN_SCREEN", 0 if screened else 1 << 60)
        drafter = MedusaDrafter(MedusaDraftConfig(tree="[[0],[1],[0,0],[0,1],[1,0],[2]]"), model=heads)
        drafts, propose = [], drafter.propose

        def record(tokens, propose=propose, drafts=drafts):
            draft = propose(tokens)
            drafts.append(torch.as_tensor(draft.tokens).tolist())
            return draft
        drafter.propose = record
        got = decode(Target(base), drafter, prompt, 24)
        assert got.tokens == want
        assert (drafter.screen is not None) == screened
        runs[screened] = drafts
    assert runs[True] == runs[False] and any(runs[True])
