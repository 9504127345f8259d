import json

import pytest

from mtpkit.eval import bench
from mtpkit.models.pld import PLDConfig
from mtpkit.models.probe import ProbeConfig


def test_method_specs_parse_to_typed_configs():
    assert bench.parse_method("probe:bc=60,masks=2,prune=0,init=sample") == (
        "probe", ProbeConfig(bc=60, masks=2, prune=False, init="sample"))
    assert bench.parse_method("pld:draft_len=4,ngram_max=2") == ("pld", PLDConfig(draft_len=4, ngram_max=2))
    assert bench.parse_method("ar")[0] == "ar"


@pytest.mark.parametrize("spec, message", [
    ("nope", "unknown method 'nope'"), ("probe:foo=1", "options of probe: bc, masks"),
    ("probe:bc=x", "option bc needs a int"), ("pld:draft_len", "bad option 'draft_len'"),
    ("ar:x=1", "options of ar: none"),
])
def test_unknown_methods_and_malformed_options_are_clear_errors(spec, message, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--methods", spec])
    assert message in capsys.readouterr().err


def test_help_explains_every_flag(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--help"])
    text = capsys.readouterr().out
    for flag in ("--backbone", "--data", "--limit", "--per-category", "--methods", "--max-new-tokens",
                 "--temperature", "--top-p", "--seed", "--dtype", "--out", "--trust-remote-code", "--linear"):
        assert flag in text
    for method in bench.METHODS:
        assert method in text


def test_bench_end_to_end_on_a_tiny_model(tmp_path, monkeypatch):
    monkeypatch.setattr("mtpkit.models.packed_linear.MIN_PACK", 0)  # pack even the tiny layers
    data = tmp_path / "specbench.jsonl"
    records = [{"question_id": i, "category": cat, "turns": [text]} for i, (cat, text) in enumerate([
        ("coding", "def add(a, b):\n    return a + b\n\nWrite a test for add."),
        ("math", "Tom has 3 apples and buys 5 more. How many apples does he have now?"),
        ("math", "The quick brown fox jumps over the lazy dog. Repeat it."),
    ])]
    data.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    out = tmp_path / "r" / "results.json"
    bench.main(["--backbone", "tiny-llama-random", "--data", str(data), "--max-new-tokens", "20",
                "--methods", "pld:draft_len=3", "probe:bc=10", "probe:bc=30,masks=2", "hf_ar", "--out", str(out)])
    results = json.loads(out.read_text())
    methods = results["methods"]
    # the target is packed (--linear auto), so AR on the stock kernels runs beside it
    assert list(methods) == ["ar", "ar_stock", "pld:draft_len=3", "probe:bc=10", "probe:bc=30,masks=2", "hf_ar"]
    stock = methods.pop("ar_stock")  # other kernels: equal tokens, or a difference at a float near-tie
    assert stock["near_tie_mismatches"] == stock["mismatches"] and stock["tau"] == 1.0
    assert methods["probe:bc=10"]["speedup_vs_stock_ar"] > 0
    assert "| vs stock AR |" in (out.parent / "results.md").read_text()
    for spec, r in methods.items():
        assert r["matches_ar"] is True, spec
        assert set(r["per_category"]) == {"coding", "math"}
        assert len(r["outputs"]) == 3
        for o in r["outputs"].values():
            assert o["prompt_ids"] and len(o["output_ids"]) <= 20
    ar = methods["ar"]
    assert ar["tau"] == 1.0 and ar["speedup_vs_ar"] == 1.0 and ar["accept_counts"] == []
    assert ar["target_calls"] == ar["new_tokens"]
    assert methods["hf_ar"]["tau"] is None
    # main table, per-cycle (MTPC metrics) table, per-category table; hf_ar has no cycles
    assert (out.parent / "results.md").read_text().count("| probe:bc=10 |") == 3
    assert (out.parent / "results.md").read_text().count("| hf_ar |") == 2
    assert ar["mu_acc"] == 0.0 and methods["probe:bc=10"]["mu_lat"] > 0
    assert (out.parent / "results.png").stat().st_size > 1000
    assert (out.parent / "results_tradeoff.png").stat().st_size > 1000


def test_bench_runs_a_gated_lora_head(tmp_path):
    import copy

    import torch

    from mtpkit.models.backbone import load_backbone
    from mtpkit.models.gated_lora import GatedLoRAConfig, GatedMTP, save_head

    base, _ = load_backbone("tiny-llama-random")
    head = GatedMTP(copy.deepcopy(base), GatedLoRAConfig(k=2, rank=4))
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    save_head(head, tmp_path / "head", "tiny-llama-random")
    out = tmp_path / "r" / "results.json"
    specs = [f"gated_lora:head={tmp_path / 'head'},decoding=linear",
             f"gated_lora:head={tmp_path / 'head'},decoding=quadratic,sampler=0,k=1"]
    bench.main(["--backbone", "tiny-llama-random", "--data", "builtin:eval", "--per-category", "1",
                "--max-new-tokens", "12", "--methods", *specs, "--out", str(out), "--linear", "stock"])
    methods = json.loads(out.read_text())["methods"]
    assert list(methods) == ["ar", *specs]  # stock kernels: no second AR
    assert "speedup_vs_stock_ar" not in methods["ar"]
    for spec in specs:
        assert methods[spec]["matches_ar"] is True
        assert methods[spec]["target_calls"] >= 4  # one per prompt at least, 4 categories


def test_bench_runs_mtpc_heads(tmp_path):
    import torch

    from mtpkit.models.backbone import load_backbone
    from mtpkit.models.mtpc import MTPCConfig, MTPCModel, save_head

    base, _ = load_backbone("tiny-byte-llama-random")
    cfg = MTPCConfig(arch="btree", n=4, r=3, lora_layers=1)
    torch.manual_seed(0)
    save_head(MTPCModel(base, cfg), tmp_path / "head", "tiny-byte-llama-random")
    out = tmp_path / "r" / "results.json"
    specs = [f"mtpc:head={tmp_path / 'head'}", f"mtpc:head={tmp_path / 'head'},cycle=bonus"]
    bench.main(["--backbone", "tiny-byte-llama-random", "--data", "builtin:eval", "--per-category", "1",
                "--max-new-tokens", "12", "--methods", *specs, "--out", str(out)])
    methods = json.loads(out.read_text())["methods"]
    assert list(methods) == ["ar", *specs]  # no layer large enough to pack: no second AR
    for spec in specs:
        assert methods[spec]["matches_ar"] is True
        assert methods[spec]["mean_draft_nodes"] > 0 and methods[spec]["max_tokens_per_s"] > 0


def test_bench_rejects_a_missing_head(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--backbone", "tiny-llama-random", "--data", "builtin:eval", "--per-category", "1",
                    "--methods", f"gated_lora:head={tmp_path / 'nothing'}", "--out", str(tmp_path / "r.json")])
    assert "mtpkit_config.json" in str(e.value)


def test_bench_forward_times_stock_and_packed(tmp_path, monkeypatch):
    from mtpkit.eval import bench_forward

    monkeypatch.setattr("mtpkit.models.packed_linear.MIN_PACK", 0)  # pack even the tiny layers
    out = tmp_path / "fwd.json"
    res = bench_forward.main(["--backbone", "tiny-llama-random", "--cache", "8", "--tokens", "1", "3",
                              "--reps", "3", "--out", str(out)])
    assert res["packed_layers"] > 0
    assert set(res["median_ms"]) == {"stock", "packed"} and all(v > 0 for v in res["median_ms"]["packed"].values())
    assert res["ratio_to_stock_first"]["stock"][1] == 1.0
    assert json.loads(out.read_text())["cache"] == 8
    with pytest.raises(SystemExit):
        bench_forward.parse_args(["--reps", "1"])
