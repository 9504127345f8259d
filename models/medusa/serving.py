"""Medusa-1 heads in the layouts two serving engines read (`train/export.py --format medusa`).

A K-head Medusa-1 head of mtpkit (`MedusaHeads`, arch medusa) is, per head i = 0..K-1 (predicting
x_{t+i+2} from h_t, the same numbering in all three codes):
    blocks.{i}.{j}.linear.weight [d, d], .bias [d]   (j = 0..layers-1: y = y + SiLU(A y + b))
    proj.{i}.weight [V, d]                            (lm_head=copy; shared: the backbone's LM head)
and maps one to one onto:

- vLLM's Medusa draft model (vllm/model_executor/models/medusa.py, `Medusa`; its config
  vllm/transformers_utils/configs/medusa.py, `MedusaConfig`, model_type "medusa"):
      blocks.{i}.layers.{j}.weight / .bias    (`ResidualBlock`: x = x + SiLU(layer(x)) per layer;
                                               the bias only with config medusa_fc_bias = true)
      lm_heads.{i}.weight [V, d]              (a `ParallelLMHead` per head, no bias)
  in `model.safetensors` beside a `config.json` with model_type, hidden_size, vocab_size,
  num_heads, num_hidden_layers, truncated_vocab_size, medusa_fc_bias.
- The Medusa reference implementation (FasterDecoding/Medusa, medusa/model/medusa_model.py:
  `MedusaModelABC.medusa_head`, a ModuleList of nn.Sequential(*[ResBlock] * medusa_num_layers,
  nn.Linear(d, V, bias=False)), loaded from `medusa_lm_head.pt` by `MedusaModel.from_pretrained`):
      {i}.0.linear.weight / .bias, {i}.1.weight
  with `config.json` fields medusa_num_heads, medusa_num_layers, base_model_name_or_path. Its
  `[ResBlock(d)] * medusa_num_layers` repeats one module, so its layers share one set of weights:
  only one block a head maps onto it (more: the vLLM files alone).

The shared LM head (lm_head=shared) is copied into every head's projection, as both engines give
each head its own. Hydra heads (they read the embeddings of the drafted tokens) and the prefix
layer have no counterpart in either engine: refused."""

from __future__ import annotations

import torch

from mtpkit.models.medusa.model import MedusaConfig

FORMAT = "medusa"  # train/export.py --format medusa
VLLM_WEIGHTS = "model.safetensors"
REFERENCE_WEIGHTS = "medusa_lm_head.pt"
ENGINE_CONFIG = "config.json"
ENGINE_FILES = (ENGINE_CONFIG, VLLM_WEIGHTS, REFERENCE_WEIGHTS)


def serving_problem(cfg: MedusaConfig) -> str | None:
    """Why these heads cannot be served by vLLM's or the reference's Medusa model, or None."""
    if cfg.arch != "medusa":
        return (f"{cfg.arch} heads read the embeddings of the tokens drafted before them; vLLM and the Medusa "
                "reference run Medusa-1 heads only (export them with --format mtpkit)")
    if cfg.prefix_layer:
        return "the heads read a prefix layer, which neither vLLM's nor the reference's Medusa model has"
    return None


def vllm_state(head: dict[str, torch.Tensor], cfg: MedusaConfig,
               lm_head: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """vLLM's `Medusa` state dict from a head folder's tensors (`head.safetensors`) and, for
    lm_head=shared, the backbone's LM head weight [V, d] (copied into every head)."""
    problem = serving_problem(cfg)
    if problem:
        raise ValueError(problem)
    if cfg.lm_head == "shared" and lm_head is None:
        raise ValueError("lm_head=shared: the backbone's LM head weight is needed")
    out = {}
    for i in range(cfg.heads):
        for j in range(cfg.layers):
            for p in ("weight", "bias"):
                out[f"blocks.{i}.layers.{j}.{p}"] = head[f"blocks.{i}.{j}.linear.{p}"]
        w = head[f"proj.{i}.weight"] if cfg.lm_head == "copy" else lm_head
        out[f"lm_heads.{i}.weight"] = w.detach().float().clone()
    return {k: v.detach().float().contiguous() for k, v in out.items()}


def reference_state(vllm: dict[str, torch.Tensor], cfg: MedusaConfig) -> dict[str, torch.Tensor]:
    """The reference's `medusa_head` state dict (`medusa_lm_head.pt`) from `vllm_state`'s;
    refused for more than one block a head (the reference ties its blocks)."""
    if cfg.layers != 1:
        raise ValueError(f"layers={cfg.layers}: the Medusa reference repeats one ResBlock medusa_num_layers times "
                         "(shared weights), so only layers=1 maps onto it")
    out = {}
    for i in range(cfg.heads):
        out[f"{i}.0.linear.weight"] = vllm[f"blocks.{i}.layers.0.weight"]
        out[f"{i}.0.linear.bias"] = vllm[f"blocks.{i}.layers.0.bias"]
        out[f"{i}.1.weight"] = vllm[f"lm_heads.{i}.weight"]
    return out


def engine_config(vllm: dict[str, torch.Tensor], cfg: MedusaConfig, base_model: str,
                  reference: bool) -> dict:
    """`config.json` for both engines: vLLM's MedusaConfig fields and, with `reference`, the
    reference's (vLLM's loader renames keys holding "num" and "heads"/"layers" onto num_heads /
    num_hidden_layers, so the reference's medusa_num_* fields agree with it)."""
    V, d = vllm["lm_heads.0.weight"].shape
    config = {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": d, "vocab_size": V,
              "num_heads": cfg.heads, "num_hidden_layers": cfg.layers, "truncated_vocab_size": V,
              "medusa_fc_bias": True, "original_lm_head": False, "torch_dtype": "float32",
              "base_model_name_or_path": base_model, "mtpkit_format": FORMAT}
    if reference:
        config.update(medusa_num_heads=cfg.heads, medusa_num_layers=cfg.layers)
    return config
