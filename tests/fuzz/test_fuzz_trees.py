"""Fuzzing draft trees: `parse_paths` on rank-path lists and specs (chainN, JSON with negative,
huge, float, string ranks, deep nesting), `load_bank` on tree and bank files with junk fields,
and MTPC's `load_tree` on both. Each works exactly or is a one-line ValueError naming the file
(or the spec)."""

from __future__ import annotations

import json
import re

from hypothesis import example, given
from hypothesis import strategies as st

from fuzzing import HUGE, JUNK, TEXT, Blob, Deep, fuzz, one_line
from mtpkit.models.mtpc.draft_trees import load_tree
from mtpkit.models.trees import Topology, load_bank, parse_paths


RANKS = st.one_of(st.integers(-2, 4), st.sampled_from(HUGE + [-(10**9)]), st.floats(-1, 3, width=16),
                  st.sampled_from(["0", "1", "x", True, None]))
PATHS = st.lists(st.one_of(st.lists(st.integers(0, 3), max_size=4), st.lists(RANKS, max_size=3), RANKS),
                 max_size=70)
TREE_JSON = st.one_of(PATHS, st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=4), max_size=70), JUNK,
                      st.dictionaries(st.sampled_from(["0", "1", "x"]), st.integers(0, 2), max_size=2))
CHAIN = st.one_of(st.integers(-5, 64).map(lambda n: f"chain{n}"), st.integers(10**4, 10**12).map(lambda n: f"chain{n}"),
                  st.sampled_from(["chain", "chainx", "chain 3", "chain+2", "chain٣", "chain5_0", "chain-0",
                                   "chain3.0"]))
NESTED = st.builds(Deep, st.integers(2, 20_000))
TREE_SPECS = st.one_of(CHAIN, TREE_JSON.map(json.dumps), NESTED, TEXT)


def _closure(spec) -> list[tuple[int, ...]] | None:
    """The rank paths a valid tree means (every prefix, by depth then ranks), or None when `spec`
    is not a list of non-empty lists of non-negative ints."""
    if not isinstance(spec, list):
        return None
    paths = set()
    for path in spec:
        if not (isinstance(path, list) and path and all(type(r) is int and r >= 0 for r in path)):
            return None
        paths.update(tuple(path[:d]) for d in range(1, len(path) + 1))
    return sorted(paths, key=lambda p: (len(p), p))


def _meaning(spec: str):
    """(kind, expected paths) of an inline spec: kind `chain` / `json` / `other`; expected None
    where the spec must be refused, "any" where either outcome is fine."""
    text = spec.strip()
    if text.startswith("chain"):
        digits = text[5:]
        if re.fullmatch(r"[0-9]+", digits):
            n = int(digits)
            return "chain", ([(0,) * d for d in range(1, n + 1)] if 1 <= n <= 64 else "any")
        return "chain", (None if re.fullmatch(r"-[0-9]*[1-9][0-9]*", digits) else "any")
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return "other", None
    return "json", _closure(value)


@fuzz(300)
@given(spec=st.one_of(TREE_SPECS, PATHS))
@example(spec="chain-5")
def test_tree_specs_parse_exactly_or_raise(cap, spec):
    """parse_paths: a list of rank paths (or its JSON, or chainN) gives exactly its paths and their
    prefixes; anything else (negative or non-integer ranks, chain-5, not a list) is a ValueError."""
    spec = spec.text() if isinstance(spec, Deep) else spec
    if isinstance(spec, str):
        kind, want = _meaning(spec)
    else:
        kind, want = "json", _closure(spec)
    try:
        with cap(64 << 20):
            got = parse_paths(spec)
    except ValueError as e:
        one_line(e)
        assert want is None or want == "any", f"{spec!r} is a valid tree {want} but was refused: {e}"
        return
    assert want is not None, f"{spec!r} ({kind}) is not a tree, but parse_paths returned {got}"
    if want != "any":
        assert got == want, f"{spec!r}: parsed as {got}, not {want}"


@st.composite
def bank_files(draw) -> bytes:
    """A tree file: one tree's rank paths, or a bank as eval/tree_frontier.py writes it, with junk
    in its fields; sometimes cut short or not UTF-8."""
    if draw(st.booleans()):
        value = draw(TREE_JSON)
    else:
        trees = draw(st.lists(st.one_of(
            st.fixed_dictionaries({"paths": TREE_JSON}, optional={
                "blocks": st.one_of(st.sampled_from(["chain", "all", "root", "leaf", "bad"]),
                                    st.lists(st.integers(-2, 5), max_size=3), JUNK),
                "name": JUNK}),
            JUNK), max_size=3))
        schedule = st.fixed_dictionaries({}, optional={
            "kind": st.sampled_from(["static", "ladder", "hyst", "x"]),
            "trees": st.one_of(st.lists(st.integers(-1, 3), max_size=3), JUNK),
            "thresholds": st.one_of(st.lists(st.floats(0, 1), max_size=2), JUNK),
            "signal": st.sampled_from(["path", "ema", "x"])})
        schedules = st.one_of(st.dictionaries(st.sampled_from(["chat", "code"]),
                                              st.one_of(st.dictionaries(st.sampled_from(["static", "ladder", "hyst"]),
                                                                        st.one_of(schedule, JUNK), max_size=2), JUNK),
                                              max_size=2), JUNK)
        value = {"trees": trees} if draw(st.integers(0, 5)) else {}
        if draw(st.booleans()):
            value["schedules"] = draw(schedules)
    data = json.dumps(value).encode()
    damage = draw(st.sampled_from(["none"] * 5 + ["cut", "bytes", "deep"]))
    if damage == "cut":
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif damage == "bytes":
        data = b"\xfe" + data
    elif damage == "deep":
        data = b"[" * 2000 + b"]" * 2000
    return Blob(data)


@fuzz(300)
@given(data=bank_files(), task=st.sampled_from([None, "chat", "nope"]))
def test_tree_bank_files_load_or_name_the_file(scratch, cap, data, task):
    """load_bank on a file: topologies and a {name: schedule} dict, or a ValueError naming the file."""
    path = scratch / "bank.json"
    path.write_bytes(data)
    try:
        with cap(64 << 20):
            trees, schedules = load_bank(str(path), task)
    except ValueError as e:
        one_line(e, path)
        return
    assert all(isinstance(t, Topology) for t in trees)
    assert isinstance(schedules, dict) and all(isinstance(s, dict) for s in schedules.values()), schedules


@fuzz(300)
@given(data=bank_files(), inline=st.one_of(TREE_SPECS, TREE_JSON.map(json.dumps)), as_file=st.booleans(),
       index=st.integers(-2, 3))
def test_mtpc_tree_loads_or_names_the_spec(scratch, cap, data, inline, as_file, index):
    """MTPC's load_tree on a tree file or an inline spec: a non-empty Topology, or a ValueError
    naming the file (or the spec)."""
    if as_file:
        path = scratch / "tree.json"
        path.write_bytes(data)
        spec, name = str(path), path
    else:
        spec = inline.text() if isinstance(inline, Deep) else inline
        name = repr(spec)
    try:
        with cap(64 << 20):
            tree = load_tree(spec, index)
    except ValueError as e:
        one_line(e, name)
        return
    assert isinstance(tree, Topology) and tree.num_nodes > 0
