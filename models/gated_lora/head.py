"""The gated-LoRA head folder: the peft adapter, the mask embeddings and sampler, the config."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from safetensors.torch import save_file

from mtpkit.models.gated_lora.model import GatedLoRAConfig, GatedMTP
from mtpkit.models.heads import (HEAD_CONFIG, ModelCard, check_finite, head_folder, read_head_config, read_json,
                                 read_weights, replacing, write_head_config)

METHOD = "gated_lora"
HEAD_WEIGHTS = "mtp_head.safetensors"
HEAD_FILES = ("adapter_config.json", "adapter_model.safetensors", HEAD_WEIGHTS)


def save_head(model: GatedMTP, out_dir, base_model: str, extra: dict | None = None,
              state_dict: dict | None = None) -> None:
    """Write `out_dir`: adapter_config.json + adapter_model.safetensors (peft), mtp_head.safetensors
    (mask embeddings, sampler) and mtpkit_config.json (method, k, base model, LoRA settings).
    `state_dict`: the full GatedMTP state dict when the module's own tensors are sharded (ZeRO-3).
    Refuses (ValueError) non-finite trainable weights before writing anything."""
    out = Path(out_dir)
    state = state_dict if state_dict is not None else model.state_dict()
    adapter = {k.removeprefix("peft."): v for k, v in state.items() if k.startswith("peft.") and "lora_" in k}
    head = {k: v.detach().contiguous() for k, v in state.items() if k == "mask_embeds" or k.startswith("sampler.")}
    check_finite({**adapter, **head}, out)
    out.mkdir(parents=True, exist_ok=True)
    model.peft.save_pretrained(str(out), state_dict={k.removeprefix("peft."): v for k, v in state.items()
                                                     if k.startswith("peft.")})
    with replacing(out / HEAD_WEIGHTS) as tmp:
        save_file(head, str(tmp))
    write_head_config(out, METHOD, base_model, {"k": model.config.k, "gated_lora": dataclasses.asdict(model.config),
                                                **(extra or {})})


def load_head(head_dir, base_model, trust_remote_code: bool = False) -> GatedMTP:
    """The GatedMTP of a head folder on `base_model` (modified in place: peft injects its layers).
    Refuses (ValueError naming the tensor and file) non-finite weights. A gated-LoRA head names
    no code, so `trust_remote_code` changes nothing (the argument every method's load_head takes)."""
    head_dir = Path(head_folder(head_dir))
    config = read_head_config(head_dir, METHOD)
    try:
        lora = GatedLoRAConfig(**config["gated_lora"])
    except (KeyError, TypeError) as e:
        raise ValueError(f"{head_dir / HEAD_CONFIG}: no valid \"gated_lora\" settings "
                         f"({type(e).__name__}: {e})") from None
    read_json(head_dir / "adapter_config.json")  # peft's own error would not name the file
    read_weights(head_dir / "adapter_model.safetensors")  # checked here: peft reads it without a check
    head = read_weights(head_dir / HEAD_WEIGHTS)
    model = GatedMTP(base_model, lora, adapter=str(head_dir))
    with torch.no_grad():
        model.mask_embeds.copy_(head.pop("mask_embeds"))
        if model.sampler is not None:
            model.sampler.load_state_dict({n.removeprefix("sampler."): t for n, t in head.items()})
    return model


def model_card(config: dict) -> ModelCard:
    """The head's model card; its text names the parts this head was trained with (a head trained
    with --sampler 0 or --lcm-weight 0 has no sampler MLP or LCM term, and its bench line says
    sampler=0)."""
    settings = config["gated_lora"]
    sampler = settings.get("sampler", True)
    losses = ["base" + (" + sampler" if sampler else "") + " cross-entropy"]
    if settings.get("lcm_weight", 1.0) > 0:
        losses.append("the latent-consistency loss")
    parts = ", ".join((["a sampler MLP"] if sampler else ["no sampler MLP (the base head speculates)"])
                      + [" and ".join(losses)])
    title = f"Gated-LoRA mask-token MTP head (k = {config['k']}) for {config['base_model']}"
    about = ("Trained with mtpkit `train/gated_lora.py` (\"Your LLM Knows the Future: Uncovering Its Multi-Token "
             "Prediction Potential\", Samragh et al., arXiv:2507.11851): k mask tokens, LoRA gated on only at mask "
             f"positions (the base model's next-token outputs are unchanged, bit for bit), {parts}. Decoding is "
             "lossless: every token is verified by the base model.")
    if not settings.get("gated", True):  # the ablation's plain-LoRA baseline
        title = f"Plain-LoRA mask-token MTP head (k = {config['k']}, an ablation baseline) for {config['base_model']}"
        about = ("Trained with mtpkit `train/gated_lora.py --gated 0`: the LoRA is on at EVERY position, so the "
                 "adapted model's next-token outputs differ from the base model's and decoding is lossless only "
                 "with respect to the adapted model (the baseline of Figure 6 in Samragh et al., arXiv:2507.11851). "
                 "Use a gated head for lossless decoding of the base model.")
    return ModelCard(
        title=title, about=about, settings=settings,
        usage="from mtpkit.models.gated_lora import load_head\nmtp = load_head('path/to/this/folder', model)",
        bench="gated_lora:head=path/to/this/folder,decoding=quadratic" + ("" if sampler else ",sampler=0"),
        library="peft")
