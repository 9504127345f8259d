import json

import pytest
import torch

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
    ("ar:x=1", "options of ar: step"), ("ar:step=fast", "option step needs one of auto, eager"),
    ("pld:step=fast", "option step needs one of auto"),
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
                 "--temperature", "--top-p", "--seed", "--dtype", "--out", "--trust-remote-code", "--linear",
                 "--retune", "--rounds", "--skip"):
        assert flag in text
    for method in bench.METHODS:
        assert method in text


def test_bench_end_to_end_on_a_tiny_model(tmp_path, monkeypatch):
    monkeypatch.setattr("mtpkit.models.packed_linear.MIN_PACK", 0)  # pack even the tiny layers
    hf_models, run_hf = [], bench.run_hf
    monkeypatch.setattr(bench, "run_hf", lambda model, *a: hf_models.append(model) or run_hf(model, *a))
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
    # the kernel plan measured for this target, every method's step cost against AR's, and AR
    # against transformers' generate, which ran on the untouched model
    kernels = results["kernels"]
    assert set(kernels["plans"]) == {"body", "head"} and len(kernels["plans"]["body"]) == max(kernels["rows"])
    assert methods["probe:bc=10"]["step_cost_vs_ar"] > 0 and "step cost vs AR" in (out.parent / "results.md").read_text()
    assert "AR baseline:" in (out.parent / "results.md").read_text()
    assert not any(type(m).__name__ == "PackedLinear" for m in hf_models[0].modules())
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
    assert list(methods) == ["ar", "hf_ar", *specs]  # stock kernels: no second AR; transformers' generate always
    assert "speedup_vs_stock_ar" not in methods["ar"]
    for spec in specs:
        assert methods[spec]["matches_ar"] is True
        assert methods[spec]["target_calls"] >= 4  # one per prompt at least, 4 categories


def test_compare_dtypes_runs_every_method_on_each_dtype_in_one_run(tmp_path):
    """--compare-dtypes: every method on a float32 and a bfloat16 target (the gated adapter cast to
    the target's dtype), each dtype's results against its own AR, and the comparison table."""
    import copy

    from mtpkit.models.backbone import load_backbone
    from mtpkit.models.gated_lora import GatedLoRAConfig, GatedMTP, save_head

    base, _ = load_backbone("tiny-llama-random")
    save_head(GatedMTP(copy.deepcopy(base), GatedLoRAConfig(k=2, rank=4)), tmp_path / "head", "tiny-llama-random")
    out = tmp_path / "r" / "results.json"
    specs = ["probe:bc=10", f"gated_lora:head={tmp_path / 'head'},decoding=quadratic"]
    bench.main(["--backbone", "tiny-llama-random", "--data", "builtin:eval", "--per-category", "1",
                "--max-new-tokens", "12", "--methods", *specs, "--out", str(out), "--linear", "stock",
                "--compare-dtypes", "float32", "bfloat16"])
    results = json.loads(out.read_text())
    assert list(results["dtypes"]) == ["float32", "bfloat16"]
    for name, run in results["dtypes"].items():
        assert run["config"]["dtype"] == name and list(run["methods"]) == ["ar", "hf_ar", *specs]
        for spec in specs:
            assert run["methods"][spec]["target_calls"] >= 4 and run["methods"][spec]["tokens_per_s"] > 0
    assert all(results["dtypes"]["float32"]["methods"][spec]["matches_ar"] for spec in specs)
    table = out.with_suffix(".md").read_text()
    assert "| method | float32 tok/s | bfloat16 tok/s | bfloat16 / float32 |" in table
    assert results["comparison"] in table


def test_bench_runs_mtpc_heads(tmp_path):
    import torch

    from mtpkit.models.backbone import load_backbone
    from mtpkit.models.mtpc import MTPCConfig, MTPCModel, save_head

    base, _ = load_backbone("tiny-byte-llama-random")
    cfg = MTPCConfig(arch="btree", n=4, r=3, lora_layers=1)
    torch.manual_seed(0)
    save_head(MTPCModel(base, cfg), tmp_path / "head", "tiny-byte-llama-random")
    out = tmp_path / "r" / "results.json"
    specs = [f"mtpc:head={tmp_path / 'head'}", f"mtpc:head={tmp_path / 'head'},n=2"]
    bench.main(["--backbone", "tiny-byte-llama-random", "--data", "builtin:eval", "--per-category", "1",
                "--max-new-tokens", "12", "--methods", *specs, "--out", str(out)])
    methods = json.loads(out.read_text())["methods"]
    assert list(methods) == ["ar", "hf_ar", *specs]  # no layer large enough to pack: no second AR
    for spec in specs:
        assert methods[spec]["matches_ar"] is True
        assert methods[spec]["mean_draft_nodes"] > 0 and methods[spec]["max_tokens_per_s"] > 0


def test_bench_rejects_a_missing_head(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--backbone", "tiny-llama-random", "--data", "builtin:eval", "--per-category", "1",
                    "--methods", f"gated_lora:head={tmp_path / 'nothing'}", "--out", str(tmp_path / "r.json")])
    assert "mtpkit_config.json" in str(e.value)


def test_bench_forward_times_stock_onednn_and_the_plan(tmp_path, monkeypatch):
    from mtpkit.eval import bench_forward

    monkeypatch.setattr("mtpkit.models.packed_linear.MIN_PACK", 0)  # pack even the tiny layers
    out = tmp_path / "fwd.json"
    res = bench_forward.main(["--backbone", "tiny-llama-random", "--cache", "8", "--tokens", "1", "3",
                              "--reps", "3", "--retune", "--out", str(out)])
    assert res["packed_layers"] > 0
    assert set(res["median_ms"]) == {"stock", "onednn", "tuned"} and all(v > 0 for v in res["median_ms"]["tuned"].values())
    plan = res["plan"]  # the table the plan came from: every body/head kernel pair at every row count
    # (a pair with the padded kernel below PACK_ROWS rows only)
    assert len(plan["median_ms"]) == 12 and all(set(t) == {m for m in plan["rows"] if "padded" not in name or m < 4}
                                                 for name, t in plan["median_ms"].items())
    assert len(plan["plans"]["body"]) == max(plan["rows"]) and not res["plan_cached"]
    assert bench_forward.main(["--backbone", "tiny-llama-random", "--cache", "8", "--tokens", "1", "--reps", "3",
                               "--out", str(out)])["plan_cached"]  # the second run reads the cache
    assert res["ratio_to_stock_first"]["stock"][1] == 1.0
    assert json.loads(out.read_text())["cache"] == 8
    with pytest.raises(SystemExit):
        bench_forward.parse_args(["--reps", "1"])


def test_bench_forward_times_a_heads_gated_copy(tmp_path, tiny):
    """--head: the gated copy's forwards beside the plain model's (on a tiny model, nothing to pack)."""
    from mtpkit.eval import bench_forward
    from mtpkit.models.gated_lora import save_head
    from tests.models.test_gated_lora import make_gated

    save_head(make_gated(tiny[0], k=2, rank=4), tmp_path / "head", "tiny-llama-random")
    res = bench_forward.main(["--backbone", "tiny-llama-random", "--cache", "8", "--tokens", "1", "4", "--reps", "3",
                              "--head", str(tmp_path / "head"), "--out", str(tmp_path / "fwd.json")])
    assert set(res["median_ms"]) == {"stock", "gated"} and res["head"] == str(tmp_path / "head")
    assert all(res["median_ms"][kind][t] > 0 for kind in ("stock", "gated") for t in (1, 4))


def test_bench_forward_times_the_gated_copy_as_the_bench_decodes_it(tmp_path, tiny, monkeypatch):
    """On a CPU with packed layers: the gated copy packed on its own plan, adapter on and off."""
    from mtpkit.eval import bench_forward
    from mtpkit.models import kernel_plan
    from mtpkit.models.gated_lora import save_head
    from tests.models.test_gated_lora import make_gated

    monkeypatch.setattr("mtpkit.models.packed_linear.MIN_PACK", 0)
    tuned = []
    real_tune = kernel_plan.tune
    monkeypatch.setattr(bench_forward, "tune", lambda model, others=(), **kw: tuned.append(list(others))
                        or real_tune(model, others, **kw))
    save_head(make_gated(tiny[0], k=2, rank=4), tmp_path / "head", "tiny-llama-random")
    res = bench_forward.main(["--backbone", "tiny-llama-random", "--cache", "8", "--tokens", "1", "3", "--reps", "3",
                              "--head", str(tmp_path / "head"), "--out", str(tmp_path / "fwd.json")])
    assert set(res["median_ms"]) == {"stock", "onednn", "tuned", "gated", "gated_tuned", "gated_tuned_off"}
    assert all(v > 0 for kind in ("gated_tuned", "gated_tuned_off") for v in res["median_ms"][kind].values())
    copy = tuned[-1][0]  # the copy got a plan of its own, over groups carrying its A rows and gate
    groups = kernel_plan.groups_of(copy)["body"]
    assert groups and all(g.plan is not None for g in groups) and any(g.gate is not None for g in groups)


def test_bench_forward_off_the_cpu_times_the_fused_groups(tmp_path, tiny, monkeypatch):
    """A GPU's kinds (made here on CPU tensors with `cpu_paths` answering False): stock and fused,
    and with --head the gated copy on torch's layers and packed the same way; no kernel plan."""
    from mtpkit.eval import bench_forward
    from mtpkit.models.gated_lora import save_head
    from tests.models.test_gated_lora import make_gated

    for where in ("mtpkit.eval.bench_forward", "mtpkit.models.packed_linear", "mtpkit.models.kernel_plan"):
        monkeypatch.setattr(f"{where}.cpu_paths", lambda device: False)
    monkeypatch.setattr("mtpkit.models.packed_linear.MIN_PACK", 0)
    from mtpkit.models.packed_linear import PackedGroup
    products = []  # (gated group?, kernel) of every fused product computed
    compute = PackedGroup._compute
    monkeypatch.setattr(PackedGroup, "_compute", lambda g, x, kernel: products.append((g.gate is not None, kernel))
                        or compute(g, x, kernel))
    save_head(make_gated(tiny[0], k=2, rank=4), tmp_path / "head", "tiny-llama-random")
    res = bench_forward.main(["--backbone", "tiny-llama-random", "--cache", "8", "--tokens", "1", "4", "--reps", "3",
                              "--head", str(tmp_path / "head"), "--out", str(tmp_path / "fwd.json")])
    assert set(res["median_ms"]) == {"stock", "fused", "gated", "gated_fused"}
    assert res["packed_layers"] > 0 and res["plan"] is None
    assert {(False, "linear"), (True, "linear")} == set(products)  # the plain and the gated groups, F.linear
    assert all(res["median_ms"][kind][t] > 0 for kind in res["median_ms"] for t in (1, 4))


# --------------------------------------------------------------------------- outputs and bad inputs

@pytest.mark.parametrize("out", ["r/results.md", "r/results.png", "r/results"])
def test_out_must_be_a_json_path(out, capsys):
    """--out x.md or x.png would be overwritten by the table or the plot: refused, naming --out."""
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", out])
    err = capsys.readouterr().err
    assert "--out must end in .json" in err and out in err


def test_output_files_derive_from_the_json_path():
    paths = bench.output_paths("runs/x/speed.json")
    assert {k: str(v) for k, v in paths.items()} == {
        "json": "runs/x/speed.json", "md": "runs/x/speed.md", "png": "runs/x/speed.png",
        "tradeoff": "runs/x/speed_tradeoff.png"}


def _no_model(*args, **kwargs):
    raise AssertionError("a model was loaded before --out was checked")


@pytest.mark.parametrize("where", ["under-a-file", "a-folder", "md-is-a-folder"])
def test_an_unwritable_out_fails_before_any_model_is_loaded(tmp_path, monkeypatch, where):
    monkeypatch.setattr(bench, "load_backbone", _no_model)
    (tmp_path / "file").write_text("x")
    out = {"under-a-file": tmp_path / "file" / "results.json", "a-folder": tmp_path / "results.json",
           "md-is-a-folder": tmp_path / "results.json"}[where]
    if where == "a-folder":
        out.mkdir()
    if where == "md-is-a-folder":
        (tmp_path / "results.md").mkdir()
    with pytest.raises(SystemExit) as e:
        bench.main(["--backbone", "tiny-llama-random", "--out", str(out)])
    assert str(e.value).startswith(f"bench: --out {out}: cannot write there")


def test_prompts_longer_than_the_context_are_skipped_with_a_warning(tmp_path, capsys):
    """tiny-byte-llama-random: 4096 positions, one token per byte; a 5000-byte prompt cannot fit."""
    data = tmp_path / "long.jsonl"
    data.write_text("\n".join(json.dumps({"id": i, "turns": [text]})
                              for i, text in enumerate(["short question?", "x" * 5000, "another one"])) + "\n")
    out = tmp_path / "results.json"
    args = ["--backbone", "tiny-byte-llama-random", "--data", str(data), "--max-new-tokens", "6", "--methods", "ar",
            "--out", str(out)]
    results = bench.main(args)
    err = capsys.readouterr().err
    assert f"1 of 3 prompts of {data} are longer than the model's context" in err and "skipped" in err
    assert "4090 tokens" in err  # 4096 positions - 6 new tokens
    assert len(results["methods"]["ar"]["outputs"]) == 2
    data.write_text(json.dumps({"id": 0, "turns": ["y" * 5000]}) + "\n")
    with pytest.raises(SystemExit, match="no prompt of --data .* fits the model's context"):
        bench.main(args)


# --------------------------------------------------------------------------- timing over rounds

def test_rounds_repeat_the_interleaved_set_and_report_median_and_spread(tmp_path, monkeypatch):
    calls = []
    real_decode = bench.decode

    def recording_decode(target, drafter, *args, **kwargs):
        calls.append(type(drafter).__name__)
        return real_decode(target, drafter, *args, **kwargs)

    monkeypatch.setattr(bench, "decode", recording_decode)
    out = tmp_path / "results.json"
    results = bench.main(["--backbone", "tiny-llama-random", "--data", "builtin:eval", "--per-category", "1",
                          "--max-new-tokens", "6", "--methods", "ar", "pld", "--linear", "stock", "--rounds", "3",
                          "--out", str(out)])
    runs = calls[4:]  # after one warm-up call and one host-read count per method
    assert len(runs) == 3 * 4 * 2  # rounds x prompts (one per category) x methods
    firsts = [runs[r * 8] for r in range(3)]  # the method that opens each round
    # ar, hf_ar (not a decode call), pld: rotated by one per round -> ar / hf_ar, pld / pld, ar
    assert firsts == ["Drafter", "PLDDrafter", "PLDDrafter"]  # the order rotates per round too
    assert results["rounds"] == 3 and json.loads(out.read_text())["rounds"] == 3
    assert set(results["machine"]) == {"cores", "load_mean", "load_max"} and results["machine"]["cores"] >= 1
    for spec, r in results["methods"].items():
        for entry in [r, *r["per_category"].values()]:
            rounds = entry["speedup_vs_ar_rounds"]
            lo, hi = entry["speedup_vs_ar_spread"]
            assert len(rounds) == 3 and (lo, hi) == (min(rounds), max(rounds))
            assert entry["speedup_vs_ar"] == round(sorted(rounds)[1], 4)  # the median
    assert results["methods"]["ar"]["speedup_vs_ar_rounds"] == [1.0, 1.0, 1.0]
    table = (tmp_path / "results.md").read_text()
    assert "median over 3 round(s)" in table and "| spread |" in table
    pld = results["methods"]["pld"]
    lo, hi = pld["speedup_vs_ar_spread"]
    assert f"| {lo:.2f}-{hi:.2f} |" in table


def test_a_stopped_run_keeps_its_finished_rounds_and_baselines_0_runs_only_the_listed(tmp_path, monkeypatch):
    out = tmp_path / "results.json"
    seen = []
    real_write = bench.write_results

    def stop_after_the_partial(*args, partial=None, **kwargs):
        results = real_write(*args, partial=partial, **kwargs)
        seen.append(json.loads(out.read_text()))
        if partial is not None:
            raise KeyboardInterrupt  # the run is stopped after its first round
        return results

    monkeypatch.setattr(bench, "write_results", stop_after_the_partial)
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--backbone", "tiny-llama-random", "--data", "builtin:eval", "--per-category", "1",
                    "--max-new-tokens", "6", "--methods", "ar", "pld", "--baselines", "0", "--rounds", "3",
                    "--out", str(out)])
    (kept,) = seen  # written after round 1, before the stop
    assert kept["partial"] == "1 of 3 rounds" and kept["rounds"] == 1
    assert list(kept["methods"]) == ["ar", "pld"]  # no hf_ar, no ar_stock
    assert kept["methods"]["pld"]["matches_ar"] is True
    assert not (tmp_path / "results.md").exists()  # the tables are the finished run's


def test_a_busy_machine_is_warned_about_in_json_table_and_plot(tmp_path, monkeypatch):
    monkeypatch.setattr(bench.os, "getloadavg", lambda: (1000.0, 1000.0, 1000.0))
    out = tmp_path / "results.json"
    bench.main(["--backbone", "tiny-llama-random", "--data", "builtin:eval", "--per-category", "1",
                "--max-new-tokens", "6", "--methods", "ar", "pld", "--linear", "stock", "--out", str(out)])
    results = json.loads(out.read_text())
    assert results["machine"]["load_mean"] == 1000.0
    assert any(w.startswith("machine busy: load average 1000.00") for w in results["warnings"])
    table = (tmp_path / "results.md").read_text()
    assert table.startswith("WARNING: machine busy")
    pld = results["methods"]["pld"]
    assert f"| pld | {pld['tau']:.2f} | {pld['tokens_per_s']:.1f} | {pld['speedup_vs_ar']:.2f} ! |" in table
    assert f"| ar | 1.00 | {results['methods']['ar']['tokens_per_s']:.1f} | 1.00 |" in table  # AR is 1 by definition


def test_hf_ar_compile_asks_transformers_for_its_static_compiled_path():
    """hf_ar:compile=1 passes transformers' static cache and a compile config to generate (its
    fastest path, the fair peer of mtpkit's AR); plain hf_ar passes neither."""
    from types import SimpleNamespace

    seen = []

    class FakeModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(4, 2)
            self.config = SimpleNamespace(model_type="llama")

        def get_input_embeddings(self):
            return self.embed

        def generate(self, ids, **kwargs):
            seen.append(kwargs)
            return torch.cat([ids, torch.tensor([[1, 2]])], dim=1)

    args = SimpleNamespace(max_new_tokens=2, temperature=0.0, top_p=1.0)
    tokenizer = SimpleNamespace(pad_token_id=0)
    for spec in ("hf_ar", "hf_ar:compile=1"):
        name, cfg = bench.parse_method(spec)
        assert bench.run_hf(FakeModel(), tokenizer, name, cfg, [3], args, {0})["tokens"] == [1, 2]
    assert "cache_implementation" not in seen[0] and "compile_config" not in seen[0]
    assert seen[1]["cache_implementation"] == "static" and seen[1]["compile_config"]._compile_all_devices
