"""Gated LoRA: NTP outputs bit-identical to the base model, losses, head save/load."""

import copy

import pytest
import torch

from mtpkit.data.chat import IGNORE
from mtpkit.data.mtp import collate_mask_inputs, mask_inputs
from mtpkit.models.gated_lora import GatedLoRAConfig, GatedMTP, SamplerMLP, load_head, save_head


def make_gated(base, k=3, rank=4, seed=0, **kw) -> GatedMTP:
    """A gated model with random NON-zero LoRA (peft initialises B = 0, which would hide bugs)."""
    mtp = GatedMTP(copy.deepcopy(base), GatedLoRAConfig(k=k, rank=rank, **kw), seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in mtp.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return mtp.eval()


def batch_of(n=14, prompt=4, k=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 300, (n,), generator=gen)
    token_labels = torch.cat([torch.full((prompt,), IGNORE), ids[prompt:]])  # Hugging Face convention
    return collate_mask_inputs([mask_inputs(ids, token_labels, k)]), ids


@torch.no_grad()
def test_ntp_outputs_bit_identical_to_base(tiny):
    base, _ = tiny
    mtp = make_gated(base)
    batch, ids = batch_of()
    # the same Figure-4 inputs (mask embeddings included) through the untouched base model
    embeds = mtp.input_embeds(batch["input_ids"], batch["mask_index"])
    plain = base.model(inputs_embeds=embeds, attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).last_hidden_state
    gated = mtp.hidden_states(batch["input_ids"], batch["mask_index"], batch["position_ids"], batch["attention_mask"])
    ntp = batch["mask_index"] == 0
    assert torch.equal(gated[ntp], plain[ntp])
    assert torch.equal(mtp.lm_head(gated[ntp]), base.lm_head(plain[ntp]))
    # the adapter is really on at the masks (otherwise the test above proves nothing)
    assert (gated[~ntp] - plain[~ntp]).abs().max() > 1e-3
    # outside a gate the adapted model is the base model, logits bit for bit
    assert torch.equal(mtp.peft.get_base_model()(ids[None]).logits, base(ids[None]).logits)


def test_gate_shape_mismatch_is_a_clear_error(tiny):
    mtp = make_gated(tiny[0])
    with pytest.raises(RuntimeError, match="gate of shape"):
        with mtp.gate(torch.ones(1, 3, dtype=torch.bool)):
            mtp.body(input_ids=torch.tensor([[1, 2, 3, 4]]))


def test_lcm_gradient_does_not_reach_the_anchor(tiny):
    mtp = make_gated(tiny[0], base_weight=0.0, sampler_weight=0.0, lcm_weight=1.0)
    batch, _ = batch_of()
    hidden = torch.randn(*batch["input_ids"].shape, mtp.embed.weight.shape[1], requires_grad=True)
    out = mtp.losses(hidden, batch["mask_index"], batch["labels"], batch["prev_ids"], batch["ntp_slot"])
    out["loss"].backward()
    is_mask = batch["mask_index"] > 0
    assert out["lcm"] > 0
    assert torch.equal(hidden.grad[~is_mask], torch.zeros_like(hidden.grad[~is_mask]))  # anchors: no gradient
    assert (hidden.grad[is_mask & (batch["labels"] != IGNORE)].abs().sum(-1) > 0).all()


def test_lcm_value_matches_its_definition(tiny):
    """Eq. 1: per NTP position t, mean over the masks predicting the same token of (z_t - z)^2
    (averaged over dimensions), then the mean over t."""
    mtp = make_gated(tiny[0], base_weight=0.0, sampler_weight=0.0)
    batch, _ = batch_of(n=9, prompt=3, k=2)
    hidden = torch.randn(*batch["input_ids"].shape, mtp.embed.weight.shape[1])
    out = mtp.losses(hidden, batch["mask_index"], batch["labels"], batch["prev_ids"], batch["ntp_slot"])
    per_t = []
    m, pos, lab = batch["mask_index"][0], batch["position_ids"][0], batch["labels"][0]
    for t in range(len(m)):
        if m[t] == 0:
            group = [j for j in range(len(m)) if m[j] > 0 and pos[j] == pos[t] and lab[j] != IGNORE]
            if group:
                per_t.append(torch.stack([(hidden[0, t] - hidden[0, j]).pow(2).mean() for j in group]).mean())
    assert torch.allclose(out["lcm"], torch.stack(per_t).mean(), rtol=1e-5)


def test_losses_are_finite_and_logged_apart(tiny):
    mtp = make_gated(tiny[0]).train()
    batch, _ = batch_of()
    out = mtp(**batch)
    for key in ("loss", "base_ntp", "base_mtp", "sampler_ntp", "sampler_mtp", "lcm", "acc_m1", "acc_m3"):
        assert torch.isfinite(out[key]), key
    out["loss"].backward()
    grads = {n: p.grad for n, p in mtp.named_parameters() if p.requires_grad}
    assert all(g is not None and g.abs().sum() > 0 for n, g in grads.items()), "every trainable part learns"
    assert not any(p.grad is not None for p in mtp.parameters() if not p.requires_grad)


def test_sampler_mlp_is_two_linear_silu_layernorm_blocks():
    mlp = SamplerMLP(8)
    kinds = [type(m).__name__ for m in mlp.blocks]
    assert kinds == ["Linear", "SiLU", "LayerNorm"] * 2
    assert mlp.blocks[0].in_features == 16 and mlp.blocks[3].out_features == 8
    assert mlp(torch.randn(5, 8), torch.randn(5, 8)).shape == (5, 8)


@torch.no_grad()
def test_head_save_load_round_trip(tiny, tmp_path):
    base = tiny[0]
    mtp = make_gated(base, seed=3)
    torch.nn.init.normal_(mtp.mask_embeds)
    save_head(mtp, tmp_path / "head", "tiny-llama-random")
    assert {p.name for p in (tmp_path / "head").iterdir()} >= {"adapter_config.json", "adapter_model.safetensors",
                                                               "mtp_head.safetensors", "mtpkit_config.json"}
    loaded = load_head(tmp_path / "head", copy.deepcopy(base)).eval()
    batch, _ = batch_of()
    args = (batch["input_ids"], batch["mask_index"], batch["position_ids"], batch["attention_mask"])
    a, b = mtp.hidden_states(*args), loaded.hidden_states(*args)
    assert torch.equal(a, b)
    assert torch.equal(mtp.sampler_logits(batch["prev_ids"], a), loaded.sampler_logits(batch["prev_ids"], b))
    assert loaded.config == mtp.config


def test_state_dict_holds_only_trainable_tensors(tiny):
    """Checkpoints skip the frozen backbone, tied embeddings included (both of their names)."""
    mtp = make_gated(tiny[0])
    trainable = {n for n, p in mtp.named_parameters() if p.requires_grad}
    assert set(mtp.state_dict()) == trainable
    assert any("lora_A" in n for n in trainable) and "mask_embeds" in trainable
    fresh = make_gated(tiny[0], seed=9)
    fresh.load_state_dict(mtp.state_dict())
    assert torch.equal(fresh.mask_embeds, mtp.mask_embeds)
