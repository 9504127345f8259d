"""The MTPC head folder: head.safetensors (circuit head + draft-layer LoRA) and the config."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from safetensors.torch import save_file

from mtpkit.models.arch import adapter_for
from mtpkit.models.atomic_write import replacing
from mtpkit.models.head_folder import (HEAD_CONFIG, check_backbone, check_finite, head_folder, read_head_config,
                                       read_weights, typed_settings, write_head_config)
from mtpkit.models.method import ModelCard
from mtpkit.models.mtpc.model import MTPCConfig, MTPCModel

METHOD = "mtpc"
HEAD_WEIGHTS = "head.safetensors"
HEAD_FILES = (HEAD_WEIGHTS,)


def save_head(model: MTPCModel, folder, base_model: str, extra: dict | None = None,
              state_dict: dict | None = None) -> None:
    """Write `folder`: head.safetensors (the trainable tensors: head and draft LoRA) and
    mtpkit_config.json (method, base model, the MTPCConfig). `state_dict`: the full model state
    dict when the module's own tensors are sharded (ZeRO-3). Refuses (ValueError) non-finite
    weights before writing anything."""
    folder = Path(folder)
    keep = set(model.trainable_state_dict())
    state = state_dict if state_dict is not None else model.state_dict()
    weights = {k: v.detach().contiguous() for k, v in state.items() if k in keep}
    check_finite(weights, folder / HEAD_WEIGHTS)
    folder.mkdir(parents=True, exist_ok=True)
    with replacing(folder / HEAD_WEIGHTS) as tmp:
        save_file(weights, str(tmp))
    write_head_config(folder, METHOD, base_model, {**dataclasses.asdict(model.cfg), **(extra or {})},
                      backbone=model.backbone)


def read_settings(folder) -> tuple[dict, MTPCConfig]:
    """(mtpkit_config.json, its typed MTPCConfig) of an MTPC head folder, checked without loading a
    model (every setting's type and range). Refuses (ValueError, one line naming the file) anything
    else."""
    folder = head_folder(folder)
    config = read_head_config(folder, METHOD)
    fields = {f.name for f in dataclasses.fields(MTPCConfig)}
    settings = typed_settings(MTPCConfig, {k: v for k, v in config.items() if k in fields}, Path(folder) / HEAD_CONFIG)
    return config, settings


def load_head(folder, backbone, trust_remote_code: bool = False, allow_other_backbone: bool = False) -> MTPCModel:
    """An exported (or checkpointed) MTPC head on `backbone`, in eval mode. Refuses (ValueError)
    settings `read_settings` rejects, non-finite weights, a head trained on another backbone unless
    `allow_other_backbone` (models/head_folder.check_backbone), and a cirkit head whose config names a
    `module:function` to import and run as its circuit builder unless `trust_remote_code` (as
    transformers' flag: only for heads whose code you trust)."""
    folder = head_folder(folder)
    config, settings = read_settings(folder)
    circuit = str(config.get("circuit", ""))
    if config.get("arch") == "cirkit" and ":" in circuit and not trust_remote_code:
        raise ValueError(f"{Path(folder) / HEAD_CONFIG}: \"circuit\": {circuit!r} names code that loading would "
                         "import and run; pass trust_remote_code=True (eval/bench.py: "
                         "mtpc:head=DIR,trust_remote_code=1) only if you trust this head")
    other = check_backbone(config, backbone, folder, allow_other_backbone)
    state = read_weights(Path(folder) / HEAD_WEIGHTS)
    V, d = adapter_for(backbone).head_weights().shape[1:]
    want = (settings.n, settings.units, V, d)
    have = tuple(state["head.unembed"].shape) if "head.unembed" in state else None
    if settings.arch != "cirkit" and have != want:
        # checked before the model is built: an edited n or r would allocate a head of another size
        raise ValueError(f"{Path(folder) / HEAD_WEIGHTS}: head.unembed has shape {have}, the config (n, r) and the "
                         f"backbone (vocabulary, width) need {want}")
    try:
        model = MTPCModel(backbone, settings)
    except ValueError as e:
        raise ValueError(f"{Path(folder) / HEAD_CONFIG}: {e}") from None
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # shapes that do not fit (another backbone, an edited config)
        raise ValueError(f"{Path(folder) / HEAD_WEIGHTS}: weights do not fit the config and backbone "
                         f"({str(e).strip().splitlines()[-1].strip()})") from None
    expected = set(model.trainable_state_dict())
    if expected - set(state) or result.unexpected_keys:
        raise ValueError(f"{folder}: weights do not fit the config (missing {sorted(expected - set(state))[:3]}, "
                         f"unexpected {result.unexpected_keys[:3]})")
    model.other_backbone = other  # the bench marks a result of a head on another backbone
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
