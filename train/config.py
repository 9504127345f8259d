"""Typed configs for the training scripts: dataclass -> YAML + command-line overrides.

Each field's attribute docstring (its own class's, or the base class's for an inherited field)
becomes its `--help` text; a nested dataclass field (the model's config) is read from a YAML
mapping of the same name and its fields are flags too (`--k 4` sets `model.k`). Precedence:
dataclass defaults < YAML < flags given on the command line. The resolved config is what gets
saved next to every checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from pathlib import Path

import yaml

from mtpkit.models.heads import field_docs


class ConfigError(ValueError):
    pass


def _flag_fields(cls, prefix=()):
    """(path, field, owner class) for every leaf field; nested dataclasses are flattened."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            yield from _flag_fields(kind, prefix + (f.name,))
        else:
            yield prefix + (f.name,), kind, cls


def _parser_for(kind):
    origin = typing.get_origin(kind)
    if kind is bool:
        return lambda s: {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}[s.lower()]
    if origin is list:
        item = typing.get_args(kind)[0]
        return lambda s: [item(x) for x in s.split(",") if x]
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        inner = [a for a in typing.get_args(kind) if a is not type(None)][0]
        return lambda s: None if s.lower() in ("none", "") else inner(s)
    return kind


def add_config_args(parser: argparse.ArgumentParser, cls) -> None:
    seen = {}
    for path, kind, owner in _flag_fields(cls):
        name = path[-1]
        if name in seen:
            raise ConfigError(f"{cls.__name__}: field {name!r} appears twice ({seen[name]} and {path})")
        seen[name] = path
        doc = _docs(owner).get(name, "")
        default = _get(cls(), path)
        parser.add_argument("--" + name.replace("_", "-"), dest="cfg__" + "__".join(path), default=None,
                            metavar=getattr(kind, "__name__", "VALUE").upper() if kind is not bool else "0|1",
                            type=_wrap_type(_parser_for(kind), name),
                            help=f"{doc} (default: {default!r})".replace("%", "%%"))


def _docs(cls) -> dict[str, str]:
    """Attribute docstrings of `cls` and of the dataclasses it extends (a subclass's own text wins)."""
    docs = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            docs.update(field_docs(klass))
    return docs


def _wrap_type(fn, name):
    def parse(text):
        try:
            return fn(text)
        except (ValueError, KeyError):
            raise argparse.ArgumentTypeError(f"--{name.replace('_', '-')}: cannot read {text!r}") from None
    parse.__name__ = name
    return parse


def _get(obj, path):
    for p in path:
        obj = getattr(obj, p)
    return obj


def from_dict(cls, values: dict, source: str):
    """Build `cls` from a (YAML) mapping, naming the file and key of anything wrong."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(values) - names
    if unknown:
        raise ConfigError(f"{source}: unknown key(s) {sorted(unknown)}; valid: {sorted(names)}")
    kwargs = {}
    for key, value in values.items():
        kind = hints[key]
        if dataclasses.is_dataclass(kind):
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: {key} must be a mapping")
            kwargs[key] = from_dict(kind, value, f"{source}:{key}")
        elif kind is float and isinstance(value, (int, str)) and not isinstance(value, bool):
            try:
                kwargs[key] = float(value)  # YAML reads 2e-4 as a string
            except ValueError:
                raise ConfigError(f"{source}: {key} must be a number, got {value!r}") from None
        else:
            kwargs[key] = value
    return cls(**kwargs)


def resolve(cls, args: argparse.Namespace):
    """Defaults < YAML (`args.config`) < flags."""
    values = {}
    if getattr(args, "config", None):
        path = Path(args.config)
        if not path.is_file():
            raise ConfigError(f"--config {path}: no such file")
        try:
            values = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
    config = from_dict(cls, values, str(getattr(args, "config", None) or "defaults"))
    for key, value in vars(args).items():
        if key.startswith("cfg__") and value is not None:
            path = key[5:].split("__")
            owner = _get(config, path[:-1])
            setattr(owner, path[-1], value)
    return config


def to_yaml(config, command: str | None = None) -> str:
    head = f"# resolved config; rerun with: {command}\n" if command else ""
    return head + yaml.safe_dump(dataclasses.asdict(config), sort_keys=False)
