"""EvaByte-class backbones through the architecture adapter (models/arch.py), on the REAL EvaByte:
its own modeling code (tests/models/evabyte_upstream/, built tiny and random by
tests/models/test_evabyte_real.py, window 16 / chunk 4). MTPC's V is the byte vocabulary, not
V x heads; the target's next-byte logits are the first head's; the draft layers (exact EVA,
mtpkit.models.evabyte.eva) reproduce the backbone's own states with zero LoRA, over a window end;
the head starts from the backbone's heads (Sec. 4.1); greedy MTPC decoding equals AR across
window ends; a few training steps lower the loss."""

import pytest
import torch

from mtpkit.models.decoding.decoder import Target, decode
from mtpkit.models.arch import EvaByteArch, LlamaArch, adapter_for
from mtpkit.models.decoding.drafter import Drafter
from mtpkit.models.mtpc import MTPCConfig, MTPCModel, window_loss, window_targets
from mtpkit.models.mtpc.circuits import log_prob
from mtpkit.models.mtpc.drafter import MTPCDraftConfig, MTPCDrafter
from tests.eval.test_mtpc_decoding import OracleMTPC
from tests.models.test_evabyte_real import HEADS, V, build, tiny_config


@pytest.fixture(scope="module")
def tiny_eva():
    return build(tiny_config(16, 4))


def ids(seed, T=24, B=1):
    return torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(seed))


def test_the_adapter_is_evabytes_and_the_vocabulary_is_bytes_not_bytes_times_heads(tiny_eva):
    adapter = adapter_for(tiny_eva)
    assert isinstance(adapter, EvaByteArch) and adapter.vocab_size == V
    assert tiny_eva.lm_head.weight.shape[0] == V * HEADS
    assert adapter.head_weights().shape == (HEADS, V, 64)
    with pytest.raises(ValueError, match="2560 rows for a vocabulary of 320"):
        LlamaArch(tiny_eva)  # the Llama assumptions refuse it, with the reason
    model = MTPCModel(tiny_eva, MTPCConfig(arch="btree", n=4, r=3))
    assert model.head.vocab_size == V and model.head.unembed.shape == (4, 3, V, 64)
    with torch.no_grad():
        assert model(ids(0), None, torch.tensor([0]), torch.tensor([5])).log_phi.shape == (1, 4, 3, V)


def test_target_next_byte_logits_are_the_first_heads(tiny_eva):
    target = Target(tiny_eva)
    x = ids(1)
    with torch.no_grad():
        hidden = target.body(input_ids=x).last_hidden_state
        mine = target.lm_head(hidden)                                                # [1, T, V]
        heads = tiny_eva(input_ids=x, return_all_pred_logits=True).logits           # [1, T, 8, V]
    assert mine.shape == (1, 24, V)
    assert torch.equal(mine, heads[..., 0, :])
    torch.testing.assert_close(mine, hidden @ tiny_eva.lm_head.weight[:V].T)   # head 0 is the first V rows
    assert not torch.allclose(mine, heads[..., 1, :])


def test_draft_layers_with_zero_lora_are_the_backbones_own_layers(tiny_eva):
    model = MTPCModel(tiny_eva, MTPCConfig(arch="btree", n=4, r=3, lora_layers=1, lora_rank=4))
    lora_b = [p for name, p in model.draft.named_parameters() if "lora_B" in name]
    assert lora_b and all(not p.any() for p in lora_b)  # peft starts B at zero
    x = ids(2, T=20)
    with torch.no_grad():  # exact EVA over the window end at 16 (the real forward: to rounding)
        torch.testing.assert_close(model.features(x), tiny_eva.model(input_ids=x).last_hidden_state,
                                   atol=1e-4, rtol=0)
        # incremental, on the draft's own EVA cache: the rotary tables at the right positions
        shared = tiny_eva.model(input_ids=x, output_hidden_states=True).hidden_states[model.draft.start]
        cache, parts = model.adapter.layer_cache(1), []
        for a, b in ((0, 7), (7, 8), (8, 20)):
            parts.append(model.draft(shared[:, a:b], torch.arange(a, b)[None], past_key_values=cache))
        torch.testing.assert_close(torch.cat(parts, 1), model.features(x), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["ff", "cp", "hmm", "btree", "cirkit"])
def test_the_head_starts_from_the_backbones_heads(tiny_eva, arch):
    """Sec. 4.1: position i starts from EvaByte's head i (the last head past it); with n <= the
    number of heads the initial circuit is exactly the backbone's own MTP model, prod_i head_i."""
    n = 4 if arch == "cirkit" else 16
    heads = tiny_eva.lm_head.weight.detach().view(HEADS, V, 64)
    model = MTPCModel(tiny_eva, MTPCConfig(arch=arch, n=n, r=3))
    units = model.head.unembed if arch != "cirkit" else None
    if arch == "cirkit":
        for m, u in zip(model.head.categoricals, model.head.unembed):
            for f, position in enumerate(m.scope_idx[:, 0].tolist()):
                assert torch.equal(u[f], heads[position][None].expand_as(u[f]))
    else:
        for i in range(n):
            assert torch.equal(units[i], heads[min(i, HEADS - 1)][None].expand_as(units[i])), i
        off = MTPCModel(tiny_eva, MTPCConfig(arch=arch, n=n, r=3, init_from_backbone_heads=False))
        assert torch.equal(off.head.unembed, heads[0][None, None].expand_as(off.head.unembed))
    if arch in ("cp", "hmm", "btree"):  # n = 8 = the heads: the circuit is EvaByte-MTP
        model = MTPCModel(tiny_eva, MTPCConfig(arch=arch, n=8, r=3)).double()
        with torch.no_grad():
            e = tiny_eva.model(input_ids=ids(3, T=6)).last_hidden_state[0].double()  # [6, d]
            params = model.head(e)
            x = torch.randint(0, V, (6, 8), generator=torch.Generator().manual_seed(4))
            ff = (e @ heads.double().transpose(1, 2)).log_softmax(-1)  # [8, 6, V]
            want = ff.gather(-1, x.T[..., None])[..., 0].sum(0)       # sum_i log head_i(x_i)
        torch.testing.assert_close(log_prob(params, x), want)


@pytest.mark.parametrize("arch,L", [("btree", 0), ("btree", 1), ("cp", 1)])
def test_greedy_mtpc_decoding_equals_ar(tiny_eva, arch, L):
    torch.manual_seed(0)
    head = MTPCModel(tiny_eva, MTPCConfig(arch=arch, n=4, r=3, lora_layers=L, lora_rank=4))
    with torch.no_grad():  # a trained-looking head: distinct ranks, non-zero LoRA
        for p in head.parameters():
            if p.requires_grad:
                p.add_(0.3 * torch.randn_like(p))
    head.eval()
    target = Target(tiny_eva)
    prompt = ids(5, T=7)[0].tolist()
    want = decode(target, Drafter(), prompt, 40).tokens
    if arch == "btree" and L == 0:  # AR through the decoder is the model's own greedy output
        seq = list(prompt)
        with torch.no_grad():
            for _ in range(40):
                seq.append(int(tiny_eva(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
        assert seq[len(prompt):] == want
    assert decode(target, MTPCDrafter(MTPCDraftConfig(), model=head), prompt, 40).tokens == want
    got = decode(target, OracleMTPC(want, head, seed=1), prompt, 40)
    assert got.tokens == want
    assert got.accept_counts and got.accept_counts[0] > 0 and len(got.accept_counts) >= 3, got.accept_counts
    assert got.tau > 1.3


def test_training_steps_lower_the_loss(tiny_eva):
    torch.manual_seed(0)
    model = MTPCModel(tiny_eva, MTPCConfig(arch="btree", n=8, r=4, lora_layers=1, lora_rank=4))
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(trainable, lr=1e-2)
    x = ids(6, T=33, B=2)
    inputs, labels = x[:, :-1], x[:, 1:]
    targets, valid = window_targets(labels, 8)                      # [B, T, n]
    rows, cols = torch.arange(2).repeat_interleave(32), torch.arange(32).repeat(2)
    losses = []
    for _ in range(6):
        loss, _ = window_loss(model(inputs, None, rows, cols), targets[rows, cols], valid[rows, cols], rows, 2, 0.9)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0] - 0.5, losses
    assert any(p.grad is not None and p.grad.any() for n, p in model.draft.named_parameters() if "lora_" in n)
