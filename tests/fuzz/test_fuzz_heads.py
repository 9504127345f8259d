"""Fuzzing head configs: a real exported head's mtpkit_config.json with wrong types, missing keys,
negative or huge values, a non-object, cut-short bytes or bad UTF-8, through each method's real
`load_head`. Each config loads or is a one-line ValueError / FileNotFoundError naming the file."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fuzzing import HUGE, JUNK, Blob, fuzz, one_line
from mtpkit.models.gated_lora import GatedLoRAConfig, GatedMTP
from mtpkit.models.gated_lora import load_head as load_gated
from mtpkit.models.gated_lora import save_head as save_gated
from mtpkit.models.mtpc import MTPCConfig, MTPCModel
from mtpkit.models.mtpc import load_head as load_mtpc
from mtpkit.models.mtpc import save_head as save_mtpc


class Heads:
    """The head folders, their configs and backbones (a short repr keeps failure reports readable)."""

    def __init__(self, folder, configs: dict, backbones: dict):
        self.folder, self.configs, self.backbones = folder, configs, backbones

    def __repr__(self) -> str:
        return f"Heads({str(self.folder)!r})"

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(repr(self))


@pytest.fixture(scope="module")
def heads(tiny, tiny_byte, tmp_path_factory):
    """A real exported gated-LoRA head (tiny-llama-random) and MTPC head (tiny-byte-llama-random),
    written once; each example rewrites only their mtpkit_config.json."""
    folder = tmp_path_factory.mktemp("heads")
    save_gated(GatedMTP(copy.deepcopy(tiny[0]), GatedLoRAConfig(k=2, rank=4)), folder / "gated", "tiny-llama-random")
    save_mtpc(MTPCModel(tiny_byte[0], MTPCConfig(arch="cp", n=4, r=3)), folder / "mtpc", "tiny-byte-llama-random")
    configs = {m: json.loads((folder / m / "mtpkit_config.json").read_text()) for m in ("gated", "mtpc")}
    return Heads(folder, configs, {"gated": tiny[0], "mtpc": tiny_byte[0]})


CONFIG_VALUES = st.one_of(JUNK, st.integers(-2, 8), st.sampled_from(HUGE),
                          st.sampled_from(["btree", "cp", "hmm", "ff", "cirkit", "tree", "q_proj", "l2", "l3",
                                           "random-binary-tree", "linear-tree", "os:getcwd"]),
                          st.lists(st.sampled_from(["q_proj", "v_proj", "nope", 5]), max_size=2))


@st.composite
def config_bytes(draw, config: dict, section: str | None, fields: list[str]) -> bytes:
    """The head's real config with some keys changed, deleted or added (in `section` when given),
    the whole replaced by a non-object, or its bytes cut short or not UTF-8."""
    config = copy.deepcopy(config)
    for _ in range(draw(st.integers(1, 4))):
        where = config[section] if section and isinstance(config.get(section), dict) and draw(st.booleans()) else config
        key = draw(st.one_of(st.sampled_from(fields + ["method", "base_model", "k", "backbone", section or "n"]),
                             st.sampled_from(["bogus", ""])))
        if draw(st.integers(0, 4)) == 0:
            where.pop(key, None)
        else:
            where[key] = draw(CONFIG_VALUES)
    if draw(st.integers(0, 9)) == 0:
        config = draw(JUNK)
    data = json.dumps(config).encode()
    damage = draw(st.sampled_from(["none"] * 6 + ["cut", "bytes", "deep", "bigint"]))
    if damage == "cut":
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif damage == "bytes":
        data = b"\xff" + data
    elif damage == "deep":
        data = data[:-1] + b', "x": ' + b"[" * 2000 + b"]" * 2000 + b"}"
    elif damage == "bigint":
        data = data[:-1] + b', "x": 1' + b"0" * 5000 + b"}"
    return Blob(data)


def _load_head_or_refuse(load, folder, backbone, data: bytes, cap) -> None:
    (folder / "mtpkit_config.json").write_bytes(data)
    try:
        with cap(1 << 30):
            load(folder, backbone)
    except (ValueError, FileNotFoundError) as e:
        one_line(e, folder)


@fuzz(100)
@given(data=st.data())
def test_gated_lora_head_config_loads_or_names_the_file(heads, cap, data):
    fields = [f.name for f in dataclasses.fields(GatedLoRAConfig)]
    config = data.draw(config_bytes(heads.configs["gated"], "gated_lora", fields), label="mtpkit_config.json")
    _load_head_or_refuse(load_gated, heads.folder / "gated", copy.deepcopy(heads.backbones["gated"]), config, cap)


@fuzz(200)
@given(data=st.data())
def test_mtpc_head_config_loads_or_names_the_file(heads, cap, data):
    fields = [f.name for f in dataclasses.fields(MTPCConfig)]
    config = data.draw(config_bytes(heads.configs["mtpc"], None, fields), label="mtpkit_config.json")
    _load_head_or_refuse(load_mtpc, heads.folder / "mtpc", heads.backbones["mtpc"], config, cap)
