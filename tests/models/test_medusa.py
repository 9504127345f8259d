"""Medusa and Hydra heads (models/medusa): an untrained head is the backbone's own next-token head,
the training rows and losses, the head folder round trip and its refusals, the named trees."""

import json
from pathlib import Path

import pytest
import torch

from mtpkit.models.medusa import (MC_SIM_7B_63, MedusaConfig, MedusaDraftConfig, MedusaDrafter, MedusaHeads,
                                  anchor_rows, choose_tree, collate_rows, load_head, save_head)
from mtpkit.models.medusa.model import IGNORE
from mtpkit.models.trees import Topology


@pytest.mark.parametrize("arch", ["medusa", "hydra"])
@torch.no_grad()
def test_untrained_heads_are_the_backbone_next_token_head(tiny, arch):
    """Zero-initialised blocks (and Hydra's residual [I 0 ...]): every head's logits are the LM
    head's on h_t, whatever the tokens Hydra reads, with a shared or a copied projection."""
    model, _ = tiny
    h = torch.randn(3, model.config.hidden_size)
    want = model.get_output_embeddings()(h)
    for lm_head in ("shared", "copy"):
        heads = MedusaHeads(model, MedusaConfig(arch=arch, heads=3, layers=2, lm_head=lm_head))
        for i in range(3):
            prev = torch.randint(0, model.config.vocab_size, (3, i + 1)) if arch == "hydra" else None
            torch.testing.assert_close(heads.logits(i, heads.hidden(i, h, prev)), want)


@torch.no_grad()
def test_an_untrained_prefix_layer_is_the_identity_and_causal(tiny):
    """Hydra++'s prefix layer starts as the identity (o_proj and down_proj zero); once changed, a
    position's output depends on the positions before it only, and the decoding cache (positions
    fed in pieces) gives the whole sequence's outputs."""
    from transformers import DynamicCache

    model, _ = tiny
    heads = MedusaHeads(model, MedusaConfig(arch="hydra", heads=2, prefix_layer=True))
    h = torch.randn(1, 6, model.config.hidden_size)
    torch.testing.assert_close(heads.prefix_states(h), h)
    for p in heads.prefix.parameters():
        p.add_(0.05 * torch.randn_like(p))
    whole = heads.prefix_states(h)
    torch.testing.assert_close(heads.prefix_states(h[:, :4]), whole[:, :4])
    cache, pieces = DynamicCache(), []
    for a, b in ((0, 3), (3, 4), (4, 6)):
        pieces.append(heads.prefix(h[:, a:b], torch.arange(a, b)[None], past_key_values=cache))
    # pieces and the whole run other kernels: rounding differs by ~1e-5, a wrong mask by ~1e-1
    torch.testing.assert_close(torch.cat(pieces, 1), whole, atol=1e-4, rtol=1e-3)


@torch.no_grad()
def test_the_last_hidden_states_entry_is_the_final_state(tiny):
    """The drafter reads hidden_states[-1] (`shared_layer = -1`) as the final, normed states."""
    model, _ = tiny
    out = model.get_decoder()(input_ids=torch.tensor([[1, 2, 3]]), output_hidden_states=True)
    torch.testing.assert_close(out.hidden_states[-1], out.last_hidden_state)


def test_anchor_rows_pair_each_position_with_the_tokens_ahead():
    """Rows are the positions whose head-1 token (t + 2) is an assistant token; future holds
    x_{t+1..t+K+1}, valid marks head i's token t + i + 1 inside the sequence and the assistant's,
    teacher_hidden the states h_{t+1..t+K}."""
    T, K = 8, 2
    ids = torch.arange(10, 10 + T)
    labels = torch.full((T,), IGNORE)
    labels[3:] = ids[3:]  # the assistant's answer starts at position 3
    hidden = torch.arange(T, dtype=torch.float)[:, None].repeat(1, 4)
    rows = anchor_rows(hidden, ids, labels, K, teacher=True)
    assert rows["hidden"][:, 0].tolist() == [1, 2, 3, 4, 5]  # t + 2 in 3..7
    assert rows["future"][0].tolist() == [12, 13, 14]
    assert rows["valid"].tolist() == [[True, True], [True, True], [True, True], [True, True], [True, False]]
    assert rows["teacher_hidden"][0, :, 0].tolist() == [2, 3]
    some = anchor_rows(hidden, ids, labels, K, positions=2, generator=torch.Generator().manual_seed(0))
    assert len(some["hidden"]) == 2
    both = collate_rows([rows, rows])
    assert both["future"].shape == (10, K + 1) and "teacher_hidden" in both


@pytest.mark.parametrize("arch,distill", [("medusa", False), ("hydra", True)])
def test_losses_fall_and_reach_every_block(tiny, arch, distill):
    model, _ = tiny
    heads = MedusaHeads(model, MedusaConfig(arch=arch, heads=2))
    ids = torch.randint(0, model.config.vocab_size, (12,))
    with torch.no_grad():
        hidden = model.get_decoder()(input_ids=ids[None]).last_hidden_state[0]
    batch = collate_rows([anchor_rows(hidden, ids, ids.clone(), 2, teacher=distill)])
    opt = torch.optim.Adam(heads.parameters(), lr=1e-2)
    first = heads(**batch)
    first["loss"].backward()
    blocks = [p for n, p in heads.named_parameters() if "linear.weight" in n]
    assert blocks and all(p.grad is not None and p.grad.abs().sum() > 0 for p in blocks)
    for _ in range(20):
        opt.zero_grad()
        heads(**batch)["loss"].backward()
        opt.step()
    last = heads(**batch)
    assert last["loss"] < first["loss"] and {"loss_h1", "loss_h2", "acc_h1", "acc_h2"} <= set(last)


@pytest.mark.parametrize("arch,lm_head,prefix", [("medusa", "shared", False), ("hydra", "copy", False),
                                                 ("hydra", "shared", True)])
def test_head_folder_round_trip(tiny, tmp_path, arch, lm_head, prefix):
    model, _ = tiny
    heads = MedusaHeads(model, MedusaConfig(arch=arch, heads=2, lm_head=lm_head, prefix_layer=prefix))
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.01 * torch.randn_like(p))
    save_head(heads, tmp_path, base_model="tiny-llama-random")
    config = json.loads((tmp_path / "mtpkit_config.json").read_text())
    assert config["method"] == arch and config["heads"] == 2 and config["lm_head"] == lm_head
    back = load_head(tmp_path, model)
    if prefix:
        seq = torch.randn(1, 5, model.config.hidden_size)
        with torch.no_grad():
            torch.testing.assert_close(back.prefix_states(seq), heads.prefix_states(seq))
    h = torch.randn(2, model.config.hidden_size)
    prev = torch.zeros(2, 2, dtype=torch.long) if arch == "hydra" else None
    with torch.no_grad():
        torch.testing.assert_close(back.logits(1, back.hidden(1, h, prev)), heads.logits(1, heads.hidden(1, h, prev)))


def test_head_folder_refusals(tiny, tmp_path):
    model, _ = tiny
    save_head(MedusaHeads(model, MedusaConfig(heads=2)), tmp_path, base_model="tiny-llama-random")
    with pytest.raises(ValueError, match="holds medusa heads; use medusa:head"):
        MedusaDrafter(MedusaDraftConfig(head=str(tmp_path)), arch="hydra")
    with pytest.raises(ValueError, match="4 deep; the head has 2 heads"):
        MedusaDrafter(MedusaDraftConfig(head=str(tmp_path), tree="mc_sim_7b_63"))
    config = json.loads((tmp_path / "mtpkit_config.json").read_text())
    (tmp_path / "mtpkit_config.json").write_text(json.dumps({**config, "heads": 3}))
    with pytest.raises(ValueError, match="weights do not fit"):
        load_head(tmp_path, model)
    (tmp_path / "mtpkit_config.json").write_text(json.dumps({**config, "arch": "hydra"}))
    with pytest.raises(ValueError, match="method 'medusa' but arch 'hydra'"):
        load_head(tmp_path, model)


def test_the_named_default_tree_is_medusas_63_node_tree():
    t = choose_tree("mc_sim_7b_63", heads=4)
    assert (t.num_nodes, t.depth, t.max_rank) == (63, 4, 10)
    assert sorted(map(tuple, MC_SIM_7B_63)) == sorted(t.paths)
    assert choose_tree("hydra_default", 5).paths == t.paths
    assert choose_tree("", 3).paths == Topology("chain3").paths
    written = json.loads((Path(__file__).resolve().parents[2] / "configs/trees/mc_sim_7b_63.json").read_text())
    assert sorted(map(tuple, written)) == sorted(t.paths)
