"""What every method's head folder shares: the `mtpkit_config.json` that names its method and
base model (with the backbone it was trained on, checked when it loads), its typed settings, and
weights that must be finite."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import types
import typing
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from mtpkit.models.atomic_write import write_atomic

HEAD_CONFIG = "mtpkit_config.json"


def head_folder(path) -> Path:
    """The head folder a user points at: `path` itself, or its `head/` (a checkpoint-N/ folder)."""
    path = Path(path)
    if not (path / HEAD_CONFIG).is_file() and (path / "head" / HEAD_CONFIG).is_file():
        return path / "head"
    return path


def check_finite(tensors: dict, source) -> None:
    """Refuse (ValueError naming the tensor and `source`, a file or folder) weights with NaN or
    inf values: a head with them drafts garbage that verification silently rejects."""
    for name, t in tensors.items():
        if torch.is_tensor(t) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise ValueError(f"{source}: tensor {name!r} has {bad} non-finite value(s) (NaN or inf)")


def write_head_config(folder, method: str, base_model: str, settings: dict, backbone=None) -> None:
    """`folder/mtpkit_config.json`: {"method", "base_model", "backbone", **settings}; `backbone`,
    the model the head was trained on, is recorded as its `backbone_identity` (checked by
    `check_backbone` when the head loads)."""
    config = {"method": method, "base_model": base_model, **settings}
    if backbone is not None:
        config["backbone"] = backbone_identity(backbone, base_model)
    write_atomic(Path(folder) / HEAD_CONFIG, json.dumps(config, indent=1))


# the architecture a head's weights and draft ranks depend on; dtype and paths are left out
BACKBONE_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings")


def backbone_identity(model, name: str | None = None) -> dict:
    """What a head records of its backbone: its name (the `--backbone` it was loaded by: a known
    name, folder or Hub id), vocabulary, width and layers, and a hash of its architecture
    (`BACKBONE_KEYS` of its config)."""
    config = model.config
    arch = {k: getattr(config, k, None) for k in BACKBONE_KEYS}
    arch = {k: v if isinstance(v, (int, float, str, bool, type(None))) else str(v) for k, v in arch.items()}
    return {"name": name if name is not None else getattr(model, "mtpkit_backbone", ""),
            "vocab_size": arch["vocab_size"], "hidden_size": arch["hidden_size"],
            "num_layers": arch["num_hidden_layers"],
            "config_hash": hashlib.sha256(json.dumps(arch, sort_keys=True).encode()).hexdigest()[:16]}


def recorded_backbone(config: dict) -> dict:
    """The `backbone_identity` a head config records; {} for a head written before heads recorded
    it (or a config whose "backbone" is not an object)."""
    recorded = config.get("backbone")
    return recorded if isinstance(recorded, dict) else {}


def check_backbone(config: dict, model, source, allow_other: bool = False) -> bool:
    """Refuse (ValueError, one line naming both) to load a head whose recorded backbone is not
    `model`: another architecture (config hash), or another name where both are known (the same
    architecture with other weights, e.g. a base and an instruct model). With `allow_other`, say so
    and go on. Returns True when the head sits on another backbone (a result to mark); a head
    written before heads recorded their backbone (no "backbone" key) is not checked."""
    recorded = recorded_backbone(config)
    if not recorded:
        return False
    here = backbone_identity(model)
    other_arch = recorded.get("config_hash") != here["config_hash"]
    other_name = bool(recorded.get("name")) and bool(here["name"]) and recorded.get("name") != here["name"]
    if not (other_arch or other_name):
        return False

    def describe(b):
        return (f"{b.get('name') or '(unnamed)'} (vocab {b.get('vocab_size')}, width {b.get('hidden_size')}, "
                f"{b.get('num_layers')} layers, config {b.get('config_hash')})")
    what = f"{source}: the head was trained on {describe(recorded)}, not on {describe(here)}"
    if not allow_other:
        raise ValueError(f"{what}; load it on its own backbone, or pass allow_other_backbone=1 "
                         "(eval/bench.py: METHOD:head=DIR,allow_other_backbone=1) to run it anyway")
    print(f"[warning] {what}: loaded anyway (allow_other_backbone=1)", file=sys.stderr)
    return True


def typed_settings(cls, values, source):
    """`cls(**values)` for a settings dataclass read from a file, every value checked against its
    field's type first (int, float, bool, str, list[str]; a JSON int is a float too, a bool is no
    number). Refuses (ValueError, one line naming `source` and the key) a value of another type, a
    key `cls` does not have, or a value its own checks reject."""
    if not isinstance(values, dict):
        raise ValueError(f"{source}: settings must be a JSON object, got {type(values).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"{source}: unknown setting(s) {unknown[:3]}; known: {', '.join(sorted(names))}")
    values = dict(values)
    for key, value in values.items():
        if not _is_a(value, hints[key]):
            raise ValueError(f"{source}: {key!r} must be {_type_name(hints[key])}, got {str(value)[:40]!r}")
        if hints[key] is float and isinstance(value, int):
            try:
                values[key] = float(value)
            except OverflowError:
                raise ValueError(f"{source}: {key!r} is out of range") from None
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: {e}") from None


def _is_a(value, kind) -> bool:
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        return any(_is_a(value, k) for k in typing.get_args(kind))
    if origin in (list, tuple):
        args = typing.get_args(kind)
        return isinstance(value, (list, tuple)) and (not args or all(_is_a(v, args[0]) for v in value))
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is type(None):
        return value is None
    return isinstance(value, kind) if isinstance(kind, type) else True


def _type_name(kind) -> str:
    if typing.get_origin(kind) in (list, tuple):
        return f"a list of {_type_name(typing.get_args(kind)[0])}" if typing.get_args(kind) else "a list"
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(k) for k in typing.get_args(kind))
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string",
            type(None): "null"}.get(kind, getattr(kind, "__name__", str(kind)))


def read_head_config(folder, method: str | None = None) -> dict:
    """The config of a head folder; with `method`, refuses a head of another method."""
    path = Path(folder) / HEAD_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{folder}: no {HEAD_CONFIG}; expected a head folder written by "
                                "train/export.py or a checkpoint's head/ folder")
    config = read_json(path)
    if not isinstance(config, dict) or "method" not in config:
        raise ValueError(f"{path}: no \"method\" key (not an mtpkit head config)")
    if method is not None and config["method"] != method:
        raise ValueError(f"{path}: method is {config['method']!r}, not {method!r}")
    return config


def read_json(path):
    """The JSON value of the file `path`; a file that is not UTF-8 JSON is a ValueError naming it."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as e:  # bad JSON or UTF-8, an int past the digit limit, deep nesting
        first = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
        raise ValueError(f"{path}: not valid JSON ({first})") from None


def read_weights(path) -> dict[str, torch.Tensor]:
    """The tensors of the .safetensors file `path`; a missing file is a FileNotFoundError, a
    truncated or corrupt one, or one holding NaN or inf values (`check_finite`), a ValueError,
    each naming the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (a head folder holds it)")
    try:
        tensors = load_file(str(path))
    except SafetensorError as e:
        raise ValueError(f"{path}: not a readable safetensors file, truncated or corrupt ({e})") from None
    check_finite(tensors, path)
    return tensors
