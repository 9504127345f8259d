"""Gated LoRA: NTP outputs bit-identical to the base model, losses, head save/load."""

import copy

import pytest
import torch

from mtpkit.data.chat import IGNORE
from mtpkit.data.mtp import choose_anchors, collate_cached, collate_mask_inputs, mask_inputs
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


@pytest.mark.parametrize("lcm", ["l2", "l2_per_dim"])
def test_lcm_value_matches_its_definition(tiny, lcm):
    """Eq. 1: per NTP position t, mean over the masks predicting the same token of the squared
    L2 distance ||z_t - z||^2 (summed over the d dimensions; divided by d for l2_per_dim), then
    the mean over t."""
    mtp = make_gated(tiny[0], base_weight=0.0, sampler_weight=0.0, lcm=lcm)
    d = mtp.embed.weight.shape[1]
    batch, _ = batch_of(n=9, prompt=3, k=2)
    hidden = torch.randn(*batch["input_ids"].shape, mtp.embed.weight.shape[1])
    out = mtp.losses(hidden, batch["mask_index"], batch["labels"], batch["prev_ids"], batch["ntp_slot"])
    per_t = []
    m, pos, lab = batch["mask_index"][0], batch["position_ids"][0], batch["labels"][0]
    for t in range(len(m)):
        if m[t] == 0:
            group = [j for j in range(len(m)) if m[j] > 0 and pos[j] == pos[t] and lab[j] != IGNORE]
            if group:
                per_t.append(torch.stack([(hidden[0, t] - hidden[0, j]).pow(2).sum() for j in group]).mean())
    expected = torch.stack(per_t).mean() / (d if lcm == "l2_per_dim" else 1)
    assert torch.allclose(out["lcm"], expected, rtol=1e-5)


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


@pytest.mark.parametrize("train_masks", [False, True])
def test_state_dict_holds_the_head_not_the_backbone(tiny, train_masks):
    """Checkpoints skip the frozen backbone, tied embeddings included (both of their names), and
    keep the mask embeddings whether trained or frozen (the paper's default: frozen)."""
    mtp = make_gated(tiny[0], train_mask_embeds=train_masks)
    trainable = {n for n, p in mtp.named_parameters() if p.requires_grad}
    assert ("mask_embeds" in trainable) == train_masks
    assert set(mtp.state_dict()) == trainable | {"mask_embeds"}
    assert any("lora_A" in n for n in trainable) and any(n.startswith("sampler.") for n in trainable)
    fresh = make_gated(tiny[0], seed=9, train_mask_embeds=train_masks)
    assert not torch.equal(fresh.mask_embeds, mtp.mask_embeds)
    fresh.load_state_dict(mtp.state_dict())
    assert torch.equal(fresh.mask_embeds, mtp.mask_embeds)


def test_frozen_mask_embeddings_get_no_gradient_and_are_saved(tiny, tmp_path):
    mtp = make_gated(tiny[0]).train()
    batch, _ = batch_of()
    mtp(**batch)["loss"].backward()
    assert mtp.mask_embeds.grad is None and not mtp.mask_embeds.requires_grad
    with torch.no_grad():
        mtp.mask_embeds.mul_(2.0)  # a frozen tensor still belongs to the head: it must round-trip
    save_head(mtp, tmp_path / "head", "tiny-llama-random")
    assert torch.equal(load_head(tmp_path / "head", copy.deepcopy(tiny[0])).mask_embeds, mtp.mask_embeds)


@torch.no_grad()
def test_plain_lora_changes_next_token_outputs_gated_does_not(tiny):
    """The ablation's baseline: plain LoRA (the gate on everywhere) changes the model's own
    next-token logits; gated LoRA leaves them bit-identical to the base."""
    base = tiny[0]
    ids = torch.randint(5, 300, (2, 11), generator=torch.Generator().manual_seed(4))
    reference = base(ids).logits
    gated, plain = make_gated(base), make_gated(base, gated=False)
    assert torch.equal(gated.next_token_logits(ids), reference)
    assert (plain.next_token_logits(ids) - reference).abs().max() > 1e-3
    # the training forward puts the adapter on the NTP slots too
    batch, _ = batch_of()
    ntp = batch["mask_index"] == 0
    args = (batch["input_ids"], batch["mask_index"], batch["position_ids"], batch["attention_mask"])
    assert (plain.hidden_states(*args)[ntp] - gated.hidden_states(*args)[ntp]).abs().max() > 1e-3
    with pytest.raises(ValueError, match="needs gated LoRA"):
        slots, _ = batch_of()
        plain(**collate_cached([mask_inputs(*_sequence(), 3)]))


def _sequence(n=14, prompt=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 300, (n,), generator=gen)
    return ids, torch.cat([torch.full((prompt,), IGNORE), ids[prompt:]])


@pytest.mark.parametrize("fraction", [1.0, 0.4])
def test_cached_two_forwards_give_the_one_forward_losses_and_gradients(tiny, fraction):
    """collate_cached (NTP once without gradient, masks over the cache) = collate_mask_inputs:
    every loss and every trainable gradient, on a padded batch of two, with every anchor and
    with a random subset."""
    mtp = make_gated(tiny[0], k=3, train_mask_embeds=True).train()
    gen = torch.Generator().manual_seed(1)
    slots = [mask_inputs(ids, labels, 3, choose_anchors(labels, fraction, gen))
             for ids, labels in (_sequence(14, 4, 0), _sequence(10, 3, 1))]
    results = []
    for collate in (collate_mask_inputs, collate_cached):
        mtp.zero_grad()
        out = mtp(**collate(slots))
        out["loss"].backward()
        results.append((out, {n: p.grad.clone() for n, p in mtp.named_parameters() if p.requires_grad}))
    (one, g1), (two, g2) = results
    for key in one:
        assert torch.allclose(one[key], two[key], rtol=1e-4, atol=1e-6, equal_nan=True), key
    for name in g1:  # summation order differs (one masked attention vs cache + block): rounding only
        assert (g1[name] - g2[name]).norm() <= 1e-4 * g1[name].norm(), name
    assert one["lcm"] > 0 and all(g.abs().sum() > 0 for g in g1.values())


def test_choose_anchors_keeps_a_share_of_the_loss_positions():
    ids, labels = _sequence(30, 6)
    gen = torch.Generator().manual_seed(0)
    chosen = choose_anchors(labels, 0.25, gen)
    loss_positions = torch.cat([labels[1:], labels.new_full((1,), IGNORE)]) != IGNORE  # 23 of them
    assert int(chosen.sum()) == round(0.25 * int(loss_positions.sum())) and not (chosen & ~loss_positions).any()
    assert choose_anchors(labels, 1.0, gen) is None
    assert not torch.equal(chosen, choose_anchors(labels, 0.25, gen))  # a fresh draw each call
    # the kept blocks are those of the full layout: same labels, positions and targets per block
    full, part = mask_inputs(ids, labels, 2), mask_inputs(ids, labels, 2, chosen)
    block = lambda s, t: s["labels"][(s["anchor"] == t) & (s["mask_index"] > 0)]
    for t in chosen.nonzero().squeeze(1).tolist():
        assert torch.equal(block(full, t), block(part, t))
    assert int((part["mask_index"] > 0).sum()) == 2 * int(chosen.sum())
    ntp_labels = part["labels"][part["mask_index"] == 0]
    assert torch.equal(ntp_labels != IGNORE, chosen)
