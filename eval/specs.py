"""Method specs, as `--methods` takes them: `name` or `name:key=value,...`, one entry of the registry
(`mtpkit.models.registry.METHODS`) and its typed options. Read by eval/bench.py and
eval/generate.py."""

from __future__ import annotations

import dataclasses
import math
import typing

from mtpkit.models.cli_help import field_docs
from mtpkit.models.decoding.step import STEP_CHOICES
from mtpkit.models.registry import METHODS


class MethodError(ValueError):
    pass


def parse_method(spec: str):
    """`probe:bc=60,masks=2` -> (name, typed config). Clear errors for anything unknown. A comma
    inside brackets belongs to its value (`tree=[[0],[1],[0,0]]`, a list of rank paths)."""
    name, _, opts = spec.partition(":")
    if name not in METHODS:
        raise MethodError(f"unknown method {name!r} in --methods {spec!r}; known: {', '.join(METHODS)}")
    cls = METHODS[name].options
    fields = {f.name: f for f in option_fields(cls)}
    values = {}
    for item in filter(None, split_options(opts)):
        key, eq, raw = item.partition("=")
        if not eq or key not in fields:
            valid = ", ".join(fields) or "none"
            raise MethodError(f"--methods {spec!r}: bad option {item!r}; options of {name}: {valid}")
        if key in values:
            raise MethodError(f"--methods {spec!r}: option {key} given twice")
        kind = typing.get_type_hints(cls)[key]
        need = "0 or 1" if kind is bool else f"a {kind.__name__}"
        if kind is bool and raw not in ("0", "1"):
            raise MethodError(f"--methods {spec!r}: option {key} needs {need}, got {raw!r}")
        try:
            values[key] = raw == "1" if kind is bool else kind(raw)
        except ValueError:
            raise MethodError(f"--methods {spec!r}: option {key} needs {need}, got {raw!r}") from None
        if kind is float and not math.isfinite(values[key]):
            raise MethodError(f"--methods {spec!r}: option {key} needs a finite number, got {raw!r}")
    if values.get("step", "") not in ("",) + STEP_CHOICES:
        raise MethodError(f"--methods {spec!r}: option step needs one of {', '.join(STEP_CHOICES)}, "
                          f"got {values['step']!r}")
    try:
        return name, cls(**values)
    except (TypeError, ValueError) as e:
        raise MethodError(f"--methods {spec!r}: {e}") from None


def option_fields(cls) -> list[dataclasses.Field]:
    """The fields of a method's options, its own (in declaration order) before those it inherits
    (e.g. `mtpkit.models.trees.TreeOptions`)."""
    own = list(vars(cls).get("__annotations__", {}))
    return sorted(dataclasses.fields(cls), key=lambda f: (0, own.index(f.name)) if f.name in own else (1, 0))


def split_options(opts: str) -> list[str]:
    """`a=1,tree=[[0],[1]]` -> ["a=1", "tree=[[0],[1]]"]: split on the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(opts):
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            items.append(opts[start:i])
            start = i + 1
    return items + [opts[start:]]


def methods_help() -> str:
    """Every method of the registry with its options, defaults and their docstrings."""
    lines = ["methods:"]
    for method in METHODS.values():
        lines.append(f"  {method.name:<12} {method.summary}")
        docs = field_docs(method.options)
        for f in option_fields(method.options):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            lines.append(f"      {f.name}={default!r}: {docs.get(f.name, '')}")
    return "\n".join(lines)


def build_drafter(spec: str):
    """The drafter of a method spec, built from its options without any model: the options are
    checked for range, against the head's files (its k, sampler, window, its backbone's
    vocabulary) and the tree files. None for a baseline without a drafter (hf_ar). Raises
    MethodError, ValueError or FileNotFoundError, one line each."""
    name, options = parse_method(spec)
    return None if METHODS[name].drafter is None else METHODS[name].drafter(options)
