"""The Medusa / Hydra head folder: head.safetensors (the heads' blocks, and their projections
with lm_head=copy) and mtpkit_config.json (method `medusa` or `hydra`, the MedusaConfig)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from safetensors.torch import save_file

from mtpkit.models.atomic_write import replacing
from mtpkit.models.head_folder import (HEAD_CONFIG, check_backbone, check_finite, head_folder, read_head_config,
                                       read_weights, typed_settings, write_head_config)
from mtpkit.models.medusa.model import ARCHS, MedusaConfig, MedusaHeads
from mtpkit.models.method import ModelCard

HEAD_WEIGHTS = "head.safetensors"
HEAD_FILES = (HEAD_WEIGHTS,)


def save_head(model: MedusaHeads, folder, base_model: str, extra: dict | None = None,
              state_dict: dict | None = None) -> None:
    """Write `folder`: head.safetensors and mtpkit_config.json (method = the arch, base model, the
    MedusaConfig). `state_dict`: the full state dict when the module's own is sharded (ZeRO-3).
    Refuses (ValueError) non-finite weights before writing anything."""
    folder = Path(folder)
    keep = set(model.trainable_state_dict())
    state = state_dict if state_dict is not None else model.state_dict()
    weights = {k: v.detach().float().contiguous() for k, v in state.items() if k in keep}
    check_finite(weights, folder / HEAD_WEIGHTS)
    folder.mkdir(parents=True, exist_ok=True)
    with replacing(folder / HEAD_WEIGHTS) as tmp:
        save_file(weights, str(tmp))
    write_head_config(folder, model.cfg.arch, base_model, {**dataclasses.asdict(model.cfg), **(extra or {})},
                      backbone=model.backbone)


def read_settings(folder) -> tuple[dict, MedusaConfig]:
    """(mtpkit_config.json, its typed MedusaConfig) of a Medusa or Hydra head folder, checked
    without loading a model. Refuses (ValueError, one line naming the file) anything else."""
    folder = head_folder(folder)
    config = read_head_config(folder)
    if config["method"] not in ARCHS:
        raise ValueError(f"{folder / HEAD_CONFIG}: method is {config['method']!r}, not one of {ARCHS}")
    fields = {f.name for f in dataclasses.fields(MedusaConfig)}
    settings = typed_settings(MedusaConfig, {k: v for k, v in config.items() if k in fields}, folder / HEAD_CONFIG)
    if settings.arch != config["method"]:
        raise ValueError(f"{folder / HEAD_CONFIG}: method {config['method']!r} but arch {settings.arch!r}")
    return config, settings


def load_head(folder, backbone, trust_remote_code: bool = False, allow_other_backbone: bool = False) -> MedusaHeads:
    """An exported (or checkpointed) Medusa or Hydra head on `backbone`, in eval mode, on the
    backbone's device. Refuses (ValueError) what `read_settings` rejects, non-finite weights,
    weights that do not fit the config and backbone, and a head trained on another backbone
    unless `allow_other_backbone` (models/head_folder.check_backbone)."""
    folder = head_folder(folder)
    config, settings = read_settings(folder)
    other = check_backbone(config, backbone, folder, allow_other_backbone)
    state = read_weights(folder / HEAD_WEIGHTS)
    model = MedusaHeads(backbone, settings)
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    have = {k: tuple(v.shape) for k, v in state.items()}
    if want != have:
        wrong = sorted(k for k in set(want) | set(have) if want.get(k) != have.get(k))
        raise ValueError(f"{folder / HEAD_WEIGHTS}: weights do not fit the config and backbone (e.g. {wrong[0]}: "
                         f"{have.get(wrong[0])} in the file, {want.get(wrong[0])} expected)")
    model.load_state_dict(state)
    model.other_backbone = other
    return model.eval()


def model_card(config: dict) -> ModelCard:
    arch = config["arch"]
    settings = {k: config[k] for k in ("arch", "heads", "layers", "lm_head", "prefix_layer") if k in config}
    paper = ("Medusa-1 heads (\"Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding "
             "Heads\", arXiv:2401.10774): residual blocks on the backbone's last hidden state, head i "
             "predicting the token i + 1 ahead independently" if arch == "medusa" else
             "Hydra heads (\"Hydra: Sequentially-Dependent Draft Heads for Medusa Decoding\", arXiv:2402.05109): "
             "head i reads the backbone's last hidden state and the embeddings of the tokens drafted before it")
    return ModelCard(
        title=f"{arch.capitalize()} draft heads (K = {config['heads']}) for {config['base_model']}",
        about=f"Trained with mtpkit `train/medusa.py --arch {arch}`: {paper}. The backbone is frozen. Decoding "
              "is lossless: every draft token, chain or tree, is verified by the base model.",
        settings=settings,
        usage="from mtpkit.models.medusa import load_head\nheads = load_head('path/to/this/folder', model)",
        bench=f"{arch}:head=path/to/this/folder,tree=mc_sim_7b_63")
