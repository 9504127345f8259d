"""What every method's head folder shares: the `mtpkit_config.json` that names its method and
base model, the check that its weights are finite, the atomic file writes (also used by the
trainers for their checkpoints and metrics), and the `Method` entry each method registers (see
`mtpkit.models.registry`); also `field_docs` (the trainers' `--help` texts) and `run_script` (how
every command-line script that imports torch ends)."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import gc
import hashlib
import inspect
import json
import types
import typing
import os
import sys
import textwrap
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

HEAD_CONFIG = "mtpkit_config.json"


def run_script(main: Callable[[], object], *, exit_status: bool = False) -> None:
    """Runs a command-line script's `main()`, then freezes the objects the garbage collector tracks
    (`gc.freeze`), so the interpreter's exit skips its cyclic collections over the ~0.4M objects
    that importing torch, transformers and DeepSpeed created: over a second per process on a
    2-core CPU, paid by every worker of a launcher.
    atexit handlers still run and objects outside reference cycles are still freed; only
    finalizers of objects in cycles are skipped at exit, which CPython does not promise to run
    anyway. With `exit_status`, main's return value is the process's exit status."""
    result = main()
    gc.freeze()
    if exit_status:
        sys.exit(result)


def field_docs(cls) -> dict[str, str]:
    """Attribute docstrings (the string literal right after `name: type = default`) of `cls` and
    of the dataclasses it extends (a subclass's own text wins)."""
    docs = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            docs.update(_own_field_docs(klass))
    return docs


@functools.cache
def _own_field_docs(cls) -> dict[str, str]:
    node = _class_node(cls)
    if node is None:
        return {}
    docs = {}
    for stmt, nxt in zip(node.body, node.body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def _class_node(cls) -> ast.ClassDef | None:
    """`cls`'s definition in its module's syntax tree (each module file parsed once), found by its
    qualified name; a class defined inside a function is read with inspect.getsource instead."""
    if "<locals>" in cls.__qualname__:
        try:
            return ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
        except (OSError, TypeError):
            return None
    try:
        filename = inspect.getsourcefile(cls)
    except TypeError:
        return None
    body = _module_tree(filename).body if filename else []
    node = None
    for name in cls.__qualname__.split("."):
        node = next((n for n in body if isinstance(n, ast.ClassDef) and n.name == name), None)
        if node is None:
            return None
        body = node.body
    return node


@functools.cache
def _module_tree(filename: str) -> ast.Module:
    try:
        return ast.parse(Path(filename).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return ast.Module(body=[], type_ignores=[])


def head_folder(path) -> Path:
    """The head folder a user points at: `path` itself, or its `head/` (a checkpoint-N/ folder)."""
    path = Path(path)
    if not (path / HEAD_CONFIG).is_file() and (path / "head" / HEAD_CONFIG).is_file():
        return path / "head"
    return path


@contextlib.contextmanager
def replacing(path) -> Iterator[Path]:
    """A temporary path beside `path` to write to; when the block ends without an error it
    replaces `path` in one step (os.replace: a reader sees the old file or the new one, never a
    part), otherwise it is removed and `path` is left as it was."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_atomic(path, data: str | bytes) -> None:
    """Write `data` to `path` through `replacing`."""
    with replacing(path) as tmp:
        tmp.write_bytes(data) if isinstance(data, bytes) else tmp.write_text(data)


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
    """(model, folder, base_model, extra=None, state_dict=None) -> None; refuses non-finite weights"""
    load_head: Callable | None = None
    """(folder, backbone, trust_remote_code=False) -> the trained model on `backbone`; refuses
    non-finite weights, and a head whose config names code to run unless trust_remote_code"""
    card: Callable[[dict], ModelCard] | None = None
    """head config -> its model card's text"""
    generate_kwargs: Callable | None = None
    """options -> extra keyword arguments of transformers' generate() (baselines without a drafter)"""
