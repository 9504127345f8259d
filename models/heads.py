"""What every method's head folder shares: the `mtpkit_config.json` that names its method and
base model, and the `Method` entry each method registers (see `mtpkit.models.registry`)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import textwrap
from pathlib import Path
from typing import Callable

HEAD_CONFIG = "mtpkit_config.json"


def field_docs(cls) -> dict[str, str]:
    """Attribute docstrings (the string literal right after `name: type = default`)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def head_folder(path) -> Path:
    """The head folder a user points at: `path` itself, or its `head/` (a checkpoint-N/ folder)."""
    path = Path(path)
    if not (path / HEAD_CONFIG).is_file() and (path / "head" / HEAD_CONFIG).is_file():
        return path / "head"
    return path


def write_head_config(folder, method: str, base_model: str, settings: dict) -> None:
    """`folder/mtpkit_config.json`: {"method", "base_model", **settings}."""
    config = {"method": method, "base_model": base_model, **settings}
    (Path(folder) / HEAD_CONFIG).write_text(json.dumps(config, indent=1))


def read_head_config(folder, method: str | None = None) -> dict:
    """The config of a head folder; with `method`, refuses a head of another method."""
    path = Path(folder) / HEAD_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{folder}: no {HEAD_CONFIG}; expected a head folder written by "
                                "train/export.py or a checkpoint's head/ folder")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict) or "method" not in config:
        raise ValueError(f"{path}: no \"method\" key (not an mtpkit head config)")
    if method is not None and config["method"] != method:
        raise ValueError(f"{path}: method is {config['method']!r}, not {method!r}")
    return config


@dataclasses.dataclass(frozen=True)
class ModelCard:
    """What a method says about one of its heads on the exported model card."""
    title: str
    about: str
    settings: dict
    usage: str
    """Python lines that load the head (after `model, tokenizer = load_backbone(...)`)"""
    bench: str = ""
    """an `eval/bench.py --methods` spec using the head, or ''"""
    library: str = "mtpkit"
    """the card's `library_name`"""


@dataclasses.dataclass(frozen=True)
class Method:
    """One row of the table of methods (`mtpkit.models.registry.METHODS`), read by the trainers,
    `train/export.py` and `eval/bench.py`."""
    name: str
    summary: str
    """one line for `eval/bench.py --help`"""
    options: type
    """dataclass of the bench options (`name:key=value,...`)"""
    drafter: Callable | None = None
    """options -> a `Drafter`; None for a baseline that is not a drafter (transformers' generate)"""
    config: type | None = None
    """dataclass of a trained head's settings (its trainer's `model:` section, saved in mtpkit_config.json)"""
    head_files: tuple[str, ...] = ()
    """files of an exported head folder (besides mtpkit_config.json); () = no trained head"""
    save_head: Callable | None = None
    """(model, folder, base_model, extra=None, state_dict=None) -> None"""
    load_head: Callable | None = None
    """(folder, backbone) -> the trained model on `backbone`"""
    card: Callable[[dict], ModelCard] | None = None
    """head config -> its model card's text"""
    generate_kwargs: Callable | None = None
    """options -> extra keyword arguments of transformers' generate() (baselines without a drafter)"""
