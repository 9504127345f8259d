"""The table of methods: one entry per name, complete for trained methods, and the only place
`eval/bench.py` and `train/export.py` learn about methods."""

import dataclasses
from pathlib import Path

import pytest

from mtpkit.eval import bench
from mtpkit.models.decoding.drafter import Drafter
from mtpkit.models.method import Method
from mtpkit.models.registry import METHODS, AROptions, trained_method

ROOT = Path(__file__).resolve().parents[2]


def test_every_entry_is_complete():
    for name, method in METHODS.items():
        assert method.name == name
        assert dataclasses.is_dataclass(method.options)
        assert (method.drafter is None) != (method.generate_kwargs is None), name  # a drafter or a generate() baseline
        trained = [method.save_head, method.load_head, method.card, method.config]
        assert all(trained) or not any(trained), name
        assert bool(method.head_files) == bool(method.save_head), name


def test_trained_methods_are_found_by_their_config_name():
    assert {m.name for m in METHODS.values() if m.save_head} == {"gated_lora", "mtpc", "medusa", "hydra"}
    with pytest.raises(ValueError, match="unknown head method 'probe'"):
        trained_method("probe")


def test_bench_and_export_know_no_method_by_name():
    """Only the baselines (`ar`, `ar_stock`, `hf_ar`: eval/report.BASELINES) are named in the bench;
    the export names none."""
    from mtpkit.eval.report import BASELINES

    named = [name for name in METHODS if name not in (*BASELINES, "pld", "probe")]
    for script in ("eval/bench.py", "train/export.py"):
        source = (ROOT / script).read_text()
        assert [name for name in named if f'"{name}"' in source or f"'{name}'" in source] == [], script


def test_a_new_entry_reaches_the_bench(monkeypatch):
    @dataclasses.dataclass
    class Options:
        width: int = 3
        """how wide"""

    class Wide(Drafter):
        def __init__(self, options):
            self.options = options

    monkeypatch.setitem(METHODS, "wide", Method("wide", "a test drafter", Options, drafter=Wide))
    name, options = bench.parse_method("wide:width=5")
    assert (name, options.width) == ("wide", 5)
    assert "wide" in bench.methods_help() and "width=3: how wide" in bench.methods_help()
    with pytest.raises(bench.MethodError, match="options of wide: width"):
        bench.parse_method("wide:depth=2")
    assert METHODS["ar"].options is AROptions
