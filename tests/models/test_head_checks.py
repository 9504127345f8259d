"""A head and its options are checked before anything runs (nothing lost, nothing
mismatched): a method option out of range or beyond the head (k, tree ranks past the
vocabulary), a head config with a value of the wrong type or a LoRA rank edited away from its
adapter's, and a head loaded on a backbone other than its own are refused with one line, before
`eval/bench.py` loads any model; `allow_other_backbone=1` runs it anyway and marks the row."""

import copy
import json
import os

import pytest

from mtpkit.eval import bench
from mtpkit.models.gated_lora import GatedLoRAConfig, GatedMTP
from mtpkit.models.gated_lora import load_head as load_gated
from mtpkit.models.gated_lora import save_head as save_gated
from mtpkit.models.head_folder import read_head_config
from mtpkit.models.mtpc import MTPCConfig, MTPCModel
from mtpkit.models.mtpc import load_head as load_mtpc
from mtpkit.models.mtpc import save_head as save_mtpc
from mtpkit.models.trees import parse_paths


@pytest.fixture(scope="module")
def gated_head(tiny, tmp_path_factory):
    folder = tmp_path_factory.mktemp("heads") / "gated"
    save_gated(GatedMTP(copy.deepcopy(tiny[0]), GatedLoRAConfig(k=2, rank=4)), folder, "tiny-llama-random")
    return folder


@pytest.fixture(scope="module")
def mtpc_head(tiny_byte, tmp_path_factory):
    folder = tmp_path_factory.mktemp("heads") / "mtpc"
    save_mtpc(MTPCModel(tiny_byte[0], MTPCConfig(arch="cp", n=4, r=3)), folder, "tiny-byte-llama-random")
    return folder


def edited(folder, tmp_path, change):
    """A copy of head `folder` whose mtpkit_config.json went through `change(config)`."""
    copy_dir = tmp_path / folder.name
    copy_dir.mkdir()
    for f in folder.iterdir():
        copy_dir.joinpath(f.name).write_bytes(f.read_bytes())
    config = json.loads((copy_dir / "mtpkit_config.json").read_text())
    change(config)
    (copy_dir / "mtpkit_config.json").write_text(json.dumps(config))
    return copy_dir


def one_line(text: str, *names) -> None:
    assert "\n" not in text.strip() and "Traceback" not in text, text
    for name in names:
        assert str(name) in text, (name, text)


@pytest.fixture
def no_model(monkeypatch):
    """bench.main's refusals must come before any model loads: loading one fails the test."""
    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the options were checked")
    monkeypatch.setattr(bench, "load_backbone", refuse)


def bench_error(capsys, tmp_path, *specs, backbone="tiny-llama-random") -> str:
    with pytest.raises(SystemExit) as e:
        bench.main(["--backbone", backbone, "--data", "builtin:eval", "--limit", "1", "--max-new-tokens", "4",
                    "--out", str(tmp_path / "r" / "results.json"), "--methods", *specs])
    text = str(e.value.code) if e.value.code not in (None, 0, 1, 2) else capsys.readouterr().err
    assert not (tmp_path / "r" / "results.json").exists()
    return text


def test_the_head_records_its_backbone(tiny, gated_head, mtpc_head, tiny_byte):
    from mtpkit.models.head_folder import backbone_identity

    assert read_head_config(gated_head)["backbone"] == backbone_identity(tiny[0], "tiny-llama-random")
    recorded = read_head_config(mtpc_head)["backbone"]
    assert recorded["name"] == "tiny-byte-llama-random" and recorded["vocab_size"] == tiny_byte[0].config.vocab_size


@pytest.mark.parametrize("k", ["-1", "99"])
def test_gated_k_out_of_range_is_refused_before_the_model_loads(gated_head, tmp_path, capsys, no_model, k):
    text = bench_error(capsys, tmp_path, f"gated_lora:head={gated_head},k={k}")
    one_line(text, f"k={k}")


def test_tree_ranks_past_the_vocabulary_are_refused(gated_head, tiny, tmp_path, capsys, no_model):
    text = bench_error(capsys, tmp_path, f"gated_lora:head={gated_head},tree=[[100000]]")
    one_line(text, "100000", f"vocabulary has {tiny[0].config.vocab_size}")


def test_probe_tree_ranks_past_the_vocabulary_are_refused_at_adapt(tiny):
    name, cfg = bench.parse_method("probe:tree=[[0],[100000]]")
    with pytest.raises(ValueError) as e:
        bench.METHODS[name].drafter(cfg).adapt(tiny[0], {})
    one_line(str(e.value), "vocabulary")


def test_a_head_config_value_of_the_wrong_type_is_one_line(gated_head, tiny, tmp_path, capsys, no_model):
    head = edited(gated_head, tmp_path, lambda c: c["gated_lora"].update(k="2"))
    with pytest.raises(ValueError) as e:
        load_gated(head, copy.deepcopy(tiny[0]))
    one_line(str(e.value), head / "mtpkit_config.json", "'k' must be an integer")
    one_line(bench_error(capsys, tmp_path, f"gated_lora:head={head}"), "'k' must be an integer")


def test_an_edited_lora_rank_is_refused(gated_head, tiny, tmp_path):
    head = edited(gated_head, tmp_path, lambda c: c["gated_lora"].update(rank=8))
    with pytest.raises(ValueError) as e:
        load_gated(head, copy.deepcopy(tiny[0]))
    one_line(str(e.value), "rank 8", "adapter_config.json")


def test_a_gated_head_on_another_backbone_is_refused(gated_head, tiny_byte):
    with pytest.raises(ValueError) as e:  # the same width: the weights alone would load
        load_gated(gated_head, copy.deepcopy(tiny_byte[0]))
    one_line(str(e.value), "tiny-llama-random", "tiny-byte-llama-random", "allow_other_backbone=1")
    assert load_gated(gated_head, copy.deepcopy(tiny_byte[0]), allow_other_backbone=True).other_backbone


def test_a_gated_head_on_another_backbone_is_refused_by_the_bench(gated_head, tmp_path, capsys):
    text = bench_error(capsys, tmp_path, f"gated_lora:head={gated_head}", backbone="tiny-byte-llama-random")
    one_line(text, "tiny-llama-random", "tiny-byte-llama-random")


def test_an_mtpc_head_on_another_backbone_is_refused(mtpc_head, tiny):
    with pytest.raises(ValueError) as e:
        load_mtpc(mtpc_head, tiny[0])
    one_line(str(e.value), "tiny-byte-llama-random", "tiny-llama-random", "allow_other_backbone=1")


def test_allow_other_backbone_runs_and_marks_the_row(gated_head, tmp_path, capsys):
    out = tmp_path / "r" / "results.json"
    spec = f"gated_lora:head={gated_head},allow_other_backbone=1"
    bench.main(["--backbone", "tiny-byte-llama-random", "--data", "builtin:eval", "--limit", "1",
                "--max-new-tokens", "4", "--rounds", "1", "--linear", "stock", "--out", str(out), "--methods", spec])
    results = json.loads(out.read_text())
    assert results["methods"][spec]["other_backbone"] is True
    assert "other_backbone" not in results["methods"]["ar"]
    assert any("allow_other_backbone=1" in w for w in results["warnings"])
    assert "allow_other_backbone=1): not a result of this head" in out.with_suffix(".md").read_text()


@pytest.mark.parametrize("spec, message", [
    ("probe:tree=chain-5", "whole number 1 <= N"), ("probe:tree=chain", "whole number 1 <= N"), ("probe:bc=10,bc=20", "bc given twice"),
    ("probe:tree=[[0.5]]", "non-negative whole ranks"), ("probe:tree=[0]", "non-negative whole ranks"),
    ("probe:prune=2", "needs 0 or 1"), ("probe:lam=nan", "finite number"), ("probe:tree=[[-1]]", "non-negative"),
])
def test_bad_option_values_are_one_line_errors(spec, message):
    with pytest.raises(ValueError) as e:
        name, cfg = bench.parse_method(spec)
        bench.METHODS[name].drafter(cfg)
    one_line(str(e.value), message)


def test_parse_paths_still_reads_trees():
    assert parse_paths("chain3") == [(0,), (0, 0), (0, 0, 0)]
    assert parse_paths("[[1, 0]]") == [(1,), (1, 0)]


@pytest.mark.parametrize("out", ["folder.json", "file/results.json", "fifo.json"])
def test_bench_refuses_an_out_that_is_not_a_file_before_anything(tmp_path, no_model, out):
    (tmp_path / "folder.json").mkdir()
    (tmp_path / "file").write_text("x")
    os.mkfifo(tmp_path / "fifo.json")
    with pytest.raises(SystemExit) as e:
        bench.main(["--backbone", "tiny-llama-random", "--out", str(tmp_path / out), "--methods", "probe"])
    one_line(str(e.value.code), "--out")
    assert (tmp_path / "file").read_text() == "x"
