"""The gated-LoRA head folder: the peft adapter, the mask embeddings and sampler, the config."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from safetensors.torch import save_file

from mtpkit.models.gated_lora.model import LCM_DISTANCES, GatedLoRAConfig, GatedMTP
from mtpkit.models.atomic_write import replacing
from mtpkit.models.head_folder import (HEAD_CONFIG, check_backbone, check_finite, head_folder, read_head_config,
                                       read_json, read_weights, typed_settings, write_head_config)
from mtpkit.models.method import ModelCard

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
                                                **(extra or {})}, backbone=model.peft.get_base_model())


def read_settings(head_dir) -> tuple[dict, GatedLoRAConfig]:
    """(mtpkit_config.json, its typed LoRA settings) of a gated-LoRA head folder, checked without
    loading a model: every setting's type and range, and the LoRA rank, alpha and target modules
    against the peft adapter's own adapter_config.json (which is what peft loads). Refuses
    (ValueError, one line naming the file and key) anything else."""
    head_dir = Path(head_folder(head_dir))
    config = read_head_config(head_dir, METHOD)
    source = head_dir / HEAD_CONFIG
    if not isinstance(config.get("gated_lora"), dict):
        raise ValueError(f"{source}: no valid \"gated_lora\" settings (an object of the LoRA settings)")
    lora = typed_settings(GatedLoRAConfig, config["gated_lora"], f"{source} gated_lora")
    if lora.k < 1 or lora.rank < 1:
        raise ValueError(f"{source}: gated_lora needs k >= 1 and rank >= 1, got k={lora.k}, rank={lora.rank}")
    if lora.lcm not in LCM_DISTANCES:
        raise ValueError(f"{source}: gated_lora lcm must be one of {LCM_DISTANCES}, got {lora.lcm!r}")
    if config.get("k", lora.k) != lora.k:
        raise ValueError(f"{source}: \"k\": {config.get('k')!r} differs from gated_lora's k {lora.k}")
    adapter = read_json(head_dir / "adapter_config.json")  # peft's own error would not name the file
    if not isinstance(adapter, dict):
        raise ValueError(f"{head_dir / 'adapter_config.json'}: not a JSON object")
    for ours, theirs in (("rank", "r"), ("alpha", "lora_alpha"), ("target_modules", "target_modules")):
        mine, peft = getattr(lora, ours), adapter.get(theirs)
        if isinstance(peft, (list, set, tuple)) and isinstance(mine, (list, tuple)):
            mine, peft = sorted(mine), sorted(peft)
        if peft != mine:
            raise ValueError(f"{source}: gated_lora {ours} {mine!r} differs from the adapter's {theirs} {peft!r} "
                             f"({head_dir / 'adapter_config.json'}); the two files come from different heads")
    return config, lora


def load_head(head_dir, base_model, trust_remote_code: bool = False, allow_other_backbone: bool = False) -> GatedMTP:
    """The GatedMTP of a head folder on `base_model` (modified in place: peft injects its layers).
    Refuses (ValueError naming the file) settings `read_settings` rejects, non-finite weights, and
    a head trained on another backbone unless `allow_other_backbone` (models/head_folder.check_backbone).
    A gated-LoRA head names no code, so `trust_remote_code` changes nothing (the argument every
    method's load_head takes)."""
    head_dir = Path(head_folder(head_dir))
    config, lora = read_settings(head_dir)
    other = check_backbone(config, base_model, head_dir, allow_other_backbone)
    read_weights(head_dir / "adapter_model.safetensors")  # checked here: peft reads it without a check
    head = read_weights(head_dir / HEAD_WEIGHTS)
    d = base_model.get_input_embeddings().weight.shape[1]
    if "mask_embeds" not in head or tuple(head["mask_embeds"].shape) != (lora.k, d):
        shape = tuple(head["mask_embeds"].shape) if "mask_embeds" in head else None
        raise ValueError(f"{head_dir / HEAD_WEIGHTS}: mask_embeds has shape {shape}, the config's k = {lora.k} "
                         f"and the backbone's width {d} need {(lora.k, d)}")
    model = GatedMTP(base_model, lora, adapter=str(head_dir))
    with torch.no_grad():
        model.mask_embeds.copy_(head.pop("mask_embeds"))
        if model.sampler is not None:
            try:
                model.sampler.load_state_dict({n.removeprefix("sampler."): t for n, t in head.items()})
            except RuntimeError as e:
                raise ValueError(f"{head_dir / HEAD_WEIGHTS}: the sampler's weights do not fit "
                                 f"({str(e).strip().splitlines()[0]})") from None
    model.other_backbone = other  # the bench marks a result of a head on another backbone
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
