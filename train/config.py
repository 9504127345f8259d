"""Typed configs for the training scripts: dataclass -> YAML + command-line overrides.

Each field's attribute docstring (its own class's, or the base class's for an inherited field)
becomes its `--help` text; a nested dataclass field (the model's config) is read from a YAML
mapping of the same name and its fields are flags too (`--k 4` sets `model.k`). Precedence:
dataclass defaults < YAML < flags given on the command line. The resolved config is what gets
saved next to every checkpoint.

Every value from a YAML or a flag is checked against its field's type (`coerce`, the one
validator): an int field takes an integer (not 2.7, not "2", not a bool), a float field a finite
number (an int is read as a float; no field takes inf or NaN), a bool field a YAML bool
(true/false, not the string "no"), a str field a string, a list field a YAML list (a bare
string is refused, not split into letters) whose items are checked in turn; Optional/Union
fields take any of their members. A YAML file must be a mapping. Range rules on top of the types
(`check`) are per recipe: (field, test, what the value must be) lines, the first broken one an
error naming its flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any, Callable

import yaml

from mtpkit.models.cli_help import field_docs

_UNIONS = (typing.Union, types.UnionType)


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
    if origin in _UNIONS:
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
        doc = field_docs(owner).get(name, "")
        default = _get(cls(), path)
        parser.add_argument(_flag(name), dest="cfg__" + "__".join(path), default=None,
                            metavar=getattr(kind, "__name__", "VALUE").upper() if kind is not bool else "0|1",
                            type=_wrap_type(_parser_for(kind), name),
                            help=f"{doc} (default: {default!r})".replace("%", "%%"))


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _wrap_type(fn, name):
    def parse(text):
        try:
            return fn(text)
        except (ValueError, KeyError):
            raise argparse.ArgumentTypeError(f"{_flag(name)}: cannot read {text!r}") from None
    parse.__name__ = name
    return parse


def _get(obj, path):
    for p in path:
        obj = getattr(obj, p)
    return obj


def _type_name(kind) -> str:
    origin = typing.get_origin(kind)
    if origin is list:
        item = typing.get_args(kind)[0]
        plural = {bool: "bools", int: "integers", float: "numbers", str: "strings"}
        return f"a list of {plural.get(item, _type_name(item))} (YAML [a, b])"
    if origin in _UNIONS:
        return " or ".join("null" if a is type(None) else _type_name(a) for a in typing.get_args(kind))
    names = {bool: "true or false", int: "an integer", float: "a finite number", str: "a string"}
    return names.get(kind, getattr(kind, "__name__", str(kind)))


def coerce(kind, value, where: str):
    """`value` checked against the field type `kind` (see the module docstring), or a ConfigError
    `{where} must be ..., got ...`. An int for a float field comes back a float, and so does a
    number string (PyYAML reads 2e-4, without a dot, as a string)."""
    origin = typing.get_origin(kind)
    if origin in _UNIONS:
        members = typing.get_args(kind)
        if value is None and type(None) in members:
            return None
        for member in members:
            try:
                return coerce(member, value, where)
            except ConfigError:
                pass
        raise ConfigError(f"{where} must be {_type_name(kind)}, got {value!r}")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be {_type_name(kind)}, got {value!r}")
        item = typing.get_args(kind)[0]
        return [coerce(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if kind is float and isinstance(value, (int, str)) and not isinstance(value, bool):
        try:
            value = float(value)
        except ValueError:
            raise ConfigError(f"{where} must be {_type_name(kind)}, got {value!r}") from None
    if not isinstance(value, kind) or (kind in (int, float) and isinstance(value, bool)):
        raise ConfigError(f"{where} must be {_type_name(kind)}, got {value!r}")
    if kind is float and not math.isfinite(value):
        raise ConfigError(f"{where} must be {_type_name(kind)}, got {value!r}")
    return value


def from_dict(cls, values, source: str, prefix: str = "", root=None):
    """Build `cls` from a (YAML) mapping, naming the file and key of anything wrong (`prefix`:
    the keys above a nested mapping, e.g. "model."; `root`: the outermost config class). An
    unknown key that is a field at another level (`k: 2` at the top, for `model.k`) says where."""
    if not isinstance(values, dict):
        what = f"{prefix.rstrip('.')}" if prefix else "the file"
        raise ConfigError(f"{source}: {what} must be a mapping of key: value lines, got {values!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(values) - names
    if unknown:
        elsewhere = [".".join(path) + (f" (indented under {path[0]}:)" if len(path) > 1 else " (at the top level)")
                     for path, _, _ in _flag_fields(root or cls) if path[-1] in unknown]
        hint = f"; did you mean {', '.join(elsewhere)}?" if elsewhere else ""
        raise ConfigError(f"{source}: unknown key(s) {sorted(prefix + str(k) for k in unknown)}; "
                          f"valid: {sorted(names)}{hint}")
    return cls(**{key: from_dict(hints[key], value, source, f"{prefix}{key}.", root or cls)
                  if dataclasses.is_dataclass(hints[key])
                  else coerce(hints[key], value, f"{source}: {prefix}{key}") for key, value in values.items()})


def resolve(cls, args: argparse.Namespace):
    """Defaults < YAML (`args.config`) < flags, each value checked by `coerce`."""
    values = {}
    if getattr(args, "config", None):
        path = Path(args.config)
        if not path.is_file():
            raise ConfigError(f"--config {path}: no such file")
        try:
            values = yaml.safe_load(path.read_text())
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        values = {} if values is None else values  # an empty file
    config = from_dict(cls, values, str(getattr(args, "config", None) or "defaults"))
    kinds = {path: kind for path, kind, _ in _flag_fields(cls)}
    for key, value in vars(args).items():
        if key.startswith("cfg__") and value is not None:
            path = tuple(key[5:].split("__"))
            setattr(_get(config, path[:-1]), path[-1], coerce(kinds[path], value, _flag(path[-1])))
    return config


Rule = tuple[str, Callable[[Any, Any], bool], str]
"""(field name, test(value, config) -> ok, what the value must be); see `check`."""


def at_least(low) -> tuple[Callable, str]:
    return (lambda v, cfg: v >= low), f">= {low}"


def above(low) -> tuple[Callable, str]:
    return (lambda v, cfg: v > low), f"> {low}"


def between(low, high) -> tuple[Callable, str]:
    return (lambda v, cfg: low <= v <= high), f"in [{low}, {high}]"


def one_of(choices) -> tuple[Callable, str]:
    return (lambda v, cfg: v in choices), f"one of {', '.join(map(str, choices))}"


NOT_EMPTY = ((lambda v, cfg: len(v) > 0), "given (not empty)")


def check(config, rules) -> None:
    """The first of `rules` (`Rule`s, checked in order) that `config` breaks, as a ConfigError
    `--flag must be ..., got value`."""
    paths = {path[-1]: path for path, _, _ in _flag_fields(type(config))}
    for name, test, must in rules:
        value = _get(config, paths[name])
        if not test(value, config):
            raise ConfigError(f"{_flag(name)} must be {must}, got {value!r}")


def to_yaml(config, command: str | None = None) -> str:
    head = f"# resolved config; rerun with: {command}\n" if command else ""
    return head + yaml.safe_dump(dataclasses.asdict(config), sort_keys=False)
