"""Fuzzing `--methods` specs through `mtpkit.eval.specs.parse_method`: the registry's method names
and option fields with garbage values (negative, huge, non-numeric, empty, repeated and unknown
keys, bad brackets in tree=[...]). Each spec parses or is a one-line MethodError / ValueError."""

from __future__ import annotations

import math
import typing

from hypothesis import given
from hypothesis import strategies as st

from fuzzing import HUGE, TEXT, fuzz, one_line
from mtpkit.eval.specs import MethodError, option_fields, parse_method
from mtpkit.models.registry import METHODS


def _value_strings():
    return st.one_of(
        st.integers(-5, 70).map(str), st.sampled_from(HUGE).map(str), st.just("9" * 5000),
        st.floats(allow_nan=True, allow_infinity=True, width=32).map(str),
        st.sampled_from(["", "x", "1_0", " 3", "+2", "0x10", "nan", "-inf", "True", "yes", "٣",
                         "[[0],[1],[0,0]]", "[[0],[1]", "[[0]]]", "]", "[", "chain5", "chain-5", "chain",
                         "a=b", "=", "a\nb", "1\n"]),
        TEXT.map(lambda t: t.replace(",", "")))


@st.composite
def method_specs(draw) -> str:
    name = draw(st.one_of(st.sampled_from(list(METHODS)), st.sampled_from(["", "AR", "nope", "probe ", "mtpc\n"])))
    keys = [f.name for f in option_fields(METHODS[name].options)] if name in METHODS else []
    items = []
    for _ in range(draw(st.integers(0, 4))):
        key = draw(st.one_of(st.sampled_from(keys), st.sampled_from(["", "bogus", "K", "k ", "tree["]))
                   if keys else st.sampled_from(["", "bogus", "k"]))
        form = draw(st.sampled_from(["kv", "kv", "kv", "key", "=v"]))
        value = draw(_value_strings())
        items.append({"kv": f"{key}={value}", "key": key, "=v": f"={value}"}[form])
    tail = draw(st.sampled_from(["", "", ",", ",,", ":"]))
    return name + (":" + ",".join(items) + tail if items or tail else "")


@fuzz(300)
@given(spec=method_specs())
def test_method_specs_parse_or_raise_method_error(cap, spec):
    try:
        with cap():
            name, options = parse_method(spec)
    except (MethodError, ValueError) as e:  # an options dataclass's own validation raises ValueError
        one_line(e)
        return
    assert name in METHODS and isinstance(options, METHODS[name].options)


def _plain_items(spec: str) -> list[tuple[str, str]] | None:
    """key, value pairs of a spec whose values hold no brackets (so how it splits is plain)."""
    _, _, opts = spec.partition(":")
    if "[" in opts or "]" in opts:
        return None
    return [tuple(item.partition("=")[::2]) for item in opts.split(",") if item]


@fuzz(150)
@given(spec=method_specs())
def test_method_spec_options_are_not_dropped(cap, spec):
    """A parsed spec kept every option it names: a key given twice is refused (the first value
    would otherwise vanish), and each option holds the value written for it."""
    try:
        with cap():
            name, options = parse_method(spec)
    except ValueError:
        return
    items = _plain_items(spec)
    if items is None:
        return
    keys = [k for k, _ in items]
    assert len(keys) == len(set(keys)), f"{spec!r}: a repeated option was accepted ({options})"
    hints = typing.get_type_hints(type(options))
    for key, raw in items:
        kind = hints[key]
        want = bool(int(raw)) if kind is bool else kind(raw)
        got = getattr(options, key)
        assert got == want or (isinstance(want, float) and math.isnan(want) and math.isnan(got)), (
            f"{spec!r}: {key} is {got!r}, written {raw!r}")
