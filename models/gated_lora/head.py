"""The gated-LoRA head folder: the peft adapter, the mask embeddings and sampler, the config."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from mtpkit.models.gated_lora.model import GatedLoRAConfig, GatedMTP
from mtpkit.models.heads import ModelCard, head_folder, read_head_config, write_head_config

METHOD = "gated_lora"
HEAD_WEIGHTS = "mtp_head.safetensors"
HEAD_FILES = ("adapter_config.json", "adapter_model.safetensors", HEAD_WEIGHTS)


def save_head(model: GatedMTP, out_dir, base_model: str, extra: dict | None = None,
              state_dict: dict | None = None) -> None:
    """Write `out_dir`: adapter_config.json + adapter_model.safetensors (peft), mtp_head.safetensors
    (mask embeddings, sampler) and mtpkit_config.json (method, k, base model, LoRA settings).
    `state_dict`: the full GatedMTP state dict when the module's own tensors are sharded (ZeRO-3)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = state_dict if state_dict is not None else model.state_dict()
    model.peft.save_pretrained(str(out), state_dict={k.removeprefix("peft."): v for k, v in state.items()
                                                     if k.startswith("peft.")})
    head = {k: v.detach().contiguous() for k, v in state.items() if k == "mask_embeds" or k.startswith("sampler.")}
    save_file(head, str(out / HEAD_WEIGHTS))
    write_head_config(out, METHOD, base_model, {"k": model.config.k, "gated_lora": dataclasses.asdict(model.config),
                                                **(extra or {})})


def load_head(head_dir, base_model) -> GatedMTP:
    """The GatedMTP of a head folder on `base_model` (modified in place: peft injects its layers)."""
    head_dir = head_folder(head_dir)
    config = read_head_config(head_dir, METHOD)
    model = GatedMTP(base_model, GatedLoRAConfig(**config["gated_lora"]), adapter=str(head_dir))
    head = load_file(str(Path(head_dir) / HEAD_WEIGHTS))
    with torch.no_grad():
        model.mask_embeds.copy_(head.pop("mask_embeds"))
        if model.sampler is not None:
            model.sampler.load_state_dict({n.removeprefix("sampler."): t for n, t in head.items()})
    return model


def model_card(config: dict) -> ModelCard:
    return ModelCard(
        title=f"Gated-LoRA mask-token MTP head (k = {config['k']}) for {config['base_model']}",
        about="Trained with mtpkit `train/gated_lora.py` (\"Your LLM Knows the Future: Uncovering Its Multi-Token "
              "Prediction Potential\", Samragh et al., arXiv:2507.11851): k mask tokens, LoRA gated on only at mask "
              "positions (the base model's next-token outputs are unchanged, bit for bit), a sampler MLP, base + "
              "sampler cross-entropy and the latent-consistency loss. Decoding is lossless: every token is verified "
              "by the base model.",
        settings=config["gated_lora"],
        usage="from mtpkit.models.gated_lora import load_head\nmtp = load_head('path/to/this/folder', model)",
        bench="gated_lora:head=path/to/this/folder,decoding=quadratic",
        library="peft")
