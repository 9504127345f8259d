"""`train/export.py --format medusa`: Medusa-1 heads in the files vLLM's Medusa draft model and
the Medusa reference implementation load, read back here WITHOUT mtpkit code by minimal copies of
those engines' module structures (same parameter names, shapes and forward), strictly, and their
logits checked against mtpkit's heads on random hidden states.

The copies follow:
- vLLM: vllm/model_executor/models/medusa.py (`ResidualBlock`, `Medusa`; vllm-project/vllm
  09cddad8f0324594022359cd2b07e962a14b895f) and vllm/transformers_utils/configs/medusa.py
  (`MedusaConfig.from_pretrained`'s key renaming; 0531c2226a6a25cd96ccc856f3bda3f0bb4efb5f). vLLM's
  `ParallelLMHead` is a [V, d] weight without bias (padded to a multiple of 64 rows on load, the
  padding cut from the logits): an nn.Linear here.
- the reference: medusa/model/medusa_model.py (`ResBlock`, `MedusaModelABC.medusa_head`;
  FasterDecoding/Medusa e2a5d20c048a9b0a4092e6933c34313687422518). Its loader builds 5 heads
  whatever the config says and loads `medusa_lm_head.pt` with strict=False; the copy here builds
  medusa_num_heads and loads strictly, which is the stronger check."""

import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from mtpkit.models.medusa import MedusaConfig, MedusaHeads, save_head
from mtpkit.train import export


class VllmResidualBlock(nn.Module):
    def __init__(self, config: dict, hidden_size: int, num_layers: int):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(hidden_size, hidden_size, bias=config.get("medusa_fc_bias", False))
                                     for _ in range(num_layers)])
        self.act = nn.SiLU()

    def forward(self, x):
        for layer in self.layers:
            x = x + self.act(layer(x))
        return x


class VllmMedusa(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        self.blocks = nn.ModuleList([VllmResidualBlock(config, config["hidden_size"], config["num_hidden_layers"])
                                     for _ in range(config["num_heads"])])
        assert config["truncated_vocab_size"] == config["vocab_size"] and not config.get("original_lm_head", False)
        self.lm_heads = nn.ModuleList([nn.Linear(config["hidden_size"], config["truncated_vocab_size"], bias=False)
                                       for _ in range(config["num_heads"])])

    def forward(self, hidden):
        return [lm_head(block(hidden)) for block, lm_head in zip(self.blocks, self.lm_heads)]


def vllm_config(path) -> dict:
    """vLLM's MedusaConfig.from_pretrained: keys holding "num" and "heads"/"layers" renamed."""
    config = json.loads(path.read_text())
    for k in list(config):
        if "num" in k:
            if "heads" in k:
                config["num_heads"] = config.pop(k)
            elif "layers" in k:
                config["num_hidden_layers"] = config.pop(k)
    assert config["model_type"] == "medusa"
    return config


class ReferenceResBlock(nn.Module):
    def __init__(self, hidden_size):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        self.act = nn.SiLU()

    def forward(self, x):
        return x + self.act(self.linear(x))


def reference_medusa_head(config: dict, hidden_size: int, vocab_size: int) -> nn.ModuleList:
    return nn.ModuleList([nn.Sequential(*([ReferenceResBlock(hidden_size)] * config["medusa_num_layers"]),
                                        nn.Linear(hidden_size, vocab_size, bias=False))
                          for _ in range(config["medusa_num_heads"])])


def trained_heads(model, tmp_path, **settings):
    """A Medusa head folder whose heads all differ (random blocks and projections)."""
    heads = MedusaHeads(model, MedusaConfig(**settings))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.1 * torch.randn_like(p))
    folder = tmp_path / "head"
    save_head(heads, folder, base_model="tiny-llama-random")
    return heads, folder


@torch.no_grad()
def mtpkit_logits(heads, h):
    return [heads.logits(i, heads.hidden(i, h)) for i in range(heads.cfg.heads)]


@pytest.mark.parametrize("lm_head", ["shared", "copy"])
@torch.no_grad()
def test_vllm_and_the_reference_load_the_export_with_mtpkits_logits(tiny, tmp_path, lm_head):
    model, _ = tiny
    heads, folder = trained_heads(model, tmp_path, heads=3, lm_head=lm_head)
    out = export.main(["--checkpoint", str(folder), "--out", str(tmp_path / "served"), "--format", "medusa"])
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "medusa_lm_head.pt",
                                                     "model.safetensors"]
    d, V = model.config.hidden_size, model.config.vocab_size
    h = torch.randn(5, d)
    want = mtpkit_logits(heads, h)

    config = vllm_config(out / "config.json")
    shape = (config["num_heads"], config["num_hidden_layers"], config["hidden_size"], config["vocab_size"])
    assert shape == (3, 1, d, V)
    vllm = VllmMedusa(config)
    vllm.load_state_dict(load_file(str(out / "model.safetensors")), strict=True)
    for got, ref in zip(vllm(h), want, strict=True):
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)

    config = json.loads((out / "config.json").read_text())  # the reference reads its own fields
    reference = reference_medusa_head(config, d, V)
    reference.load_state_dict(torch.load(out / "medusa_lm_head.pt", weights_only=True), strict=True)
    for i in range(3):
        torch.testing.assert_close(reference[i](h), want[i], atol=1e-6, rtol=1e-6)
    assert config["base_model_name_or_path"] == "tiny-llama-random"


@torch.no_grad()
def test_heads_of_two_blocks_get_the_vllm_files_alone(tiny, tmp_path):
    """The reference repeats one ResBlock module medusa_num_layers times (tied weights): two
    different blocks a head map onto vLLM's ResidualBlock only."""
    model, _ = tiny
    heads, folder = trained_heads(model, tmp_path, heads=2, layers=2)
    out = export.main(["--checkpoint", str(folder), "--out", str(tmp_path / "served"), "--format", "medusa"])
    assert not (out / "medusa_lm_head.pt").exists()
    config = json.loads((out / "config.json").read_text())
    assert "medusa_num_layers" not in config
    vllm = VllmMedusa(vllm_config(out / "config.json"))
    vllm.load_state_dict(load_file(str(out / "model.safetensors")), strict=True)
    h = torch.randn(4, model.config.hidden_size)
    for got, ref in zip(vllm(h), mtpkit_logits(heads, h), strict=True):
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("settings,needle", [
    ({"arch": "hydra"}, "--format medusa: hydra heads read the embeddings"),
    ({"prefix_layer": True}, "--format medusa: the heads read a prefix layer")])
def test_heads_no_engine_runs_are_refused_in_one_line(tiny, tmp_path, settings, needle):
    model, _ = tiny
    _, folder = trained_heads(model, tmp_path, heads=2, **settings)
    with pytest.raises(SystemExit) as e:
        export.main(["--checkpoint", str(folder), "--out", str(tmp_path / "served"), "--format", "medusa"])
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "served").exists()


def test_an_engine_export_is_replaced_by_the_next(tiny, tmp_path):
    """A --format medusa folder counts as an earlier export: exporting into it again needs no
    --overwrite, and an mtpkit export there leaves none of the engine's files."""
    model, _ = tiny
    _, folder = trained_heads(model, tmp_path, heads=2)
    out = tmp_path / "served"
    export.main(["--checkpoint", str(folder), "--out", str(out), "--format", "medusa"])
    export.main(["--checkpoint", str(folder), "--out", str(out), "--format", "medusa"])
    export.main(["--checkpoint", str(folder), "--out", str(out)])
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "head.safetensors", "mtpkit_config.json"]
