"""The MTPC head folder: head.safetensors (circuit head + draft-layer LoRA) and the config."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from safetensors.torch import load_file, save_file

from mtpkit.models.heads import ModelCard, head_folder, read_head_config, write_head_config
from mtpkit.models.mtpc.model import MTPCConfig, MTPCModel

METHOD = "mtpc"
HEAD_WEIGHTS = "head.safetensors"
HEAD_FILES = (HEAD_WEIGHTS,)


def save_head(model: MTPCModel, folder, base_model: str, extra: dict | None = None,
              state_dict: dict | None = None) -> None:
    """Write `folder`: head.safetensors (the trainable tensors: head and draft LoRA) and
    mtpkit_config.json (method, base model, the MTPCConfig). `state_dict`: the full model state
    dict when the module's own tensors are sharded (ZeRO-3)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    keep = set(model.trainable_state_dict())
    state = state_dict if state_dict is not None else model.state_dict()
    save_file({k: v.detach().contiguous() for k, v in state.items() if k in keep}, str(folder / HEAD_WEIGHTS))
    write_head_config(folder, METHOD, base_model, {**dataclasses.asdict(model.cfg), **(extra or {})})


def load_head(folder, backbone) -> MTPCModel:
    """An exported (or checkpointed) MTPC head on `backbone`, in eval mode."""
    folder = head_folder(folder)
    config = read_head_config(folder, METHOD)
    fields = {f.name for f in dataclasses.fields(MTPCConfig)}
    model = MTPCModel(backbone, MTPCConfig(**{k: v for k, v in config.items() if k in fields}))
    state = load_file(str(Path(folder) / HEAD_WEIGHTS))
    result = model.load_state_dict(state, strict=False)
    expected = set(model.trainable_state_dict())
    if expected - set(state) or result.unexpected_keys:
        raise ValueError(f"{folder}: weights do not fit the config (missing {sorted(expected - set(state))[:3]}, "
                         f"unexpected {result.unexpected_keys[:3]})")
    return model.eval()


def model_card(config: dict) -> ModelCard:
    settings = {k: config[k] for k in ("arch", "n", "r", "lora_layers", "lora_rank", "lora_alpha") if k in config}
    return ModelCard(
        title=f"MTPC {config['arch']} circuit head (n = {config['n']}, r = {config['r']}) for {config['base_model']}",
        about="Trained with mtpkit `train/mtpc.py` (MTPC, \"Fast and Expressive Multi-Byte Prediction with "
              "Probabilistic Circuits\", arXiv:2511.11346): a probabilistic circuit over the next n bytes "
              "parameterised by the backbone's hidden state, optionally on a LoRA copy of its last layers. "
              "Decoding is lossless: every byte is verified by the base model.",
        settings=settings,
        usage="from mtpkit.models.mtpc import load_head\nhead = load_head('path/to/this/folder', model)",
        bench="mtpc:head=path/to/this/folder")
