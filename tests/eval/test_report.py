from types import SimpleNamespace

import torch

from mtpkit.eval.report import explain_mismatch, first_difference, markdown_table, timing_warnings, write_plot


class FixedLogits:
    """A stand-in target whose next-token logits are fixed: [V] for every prefix."""

    def __init__(self, row):
        self.row = torch.tensor(row)

    def __call__(self, input_ids):
        return SimpleNamespace(logits=self.row.expand(1, input_ids.shape[1], -1))


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_mismatch_at_a_near_tie_is_recognised_and_counted():
    tie = explain_mismatch(FixedLogits([0.0, 3.0, 3.0 - 5e-5, 1.0]), [7, 8], [1, 1, 2], [1, 1, 1])
    assert tie["position"] == 2 and tie["near_tie"] and tie["top2_gap"] < 1e-4


def test_mismatch_without_a_tie_is_not_excused():
    real = explain_mismatch(FixedLogits([0.0, 3.0, 2.0, 1.0]), [7, 8], [1, 1, 2], [1, 1, 1])
    assert not real["near_tie"] and abs(real["top2_gap"] - 1.0) < 1e-6


# --------------------------------------------------------------------------- timing warnings

def _entry(tau, rounds):
    """A method's (or category's) summary with per-round speed-ups, as summarise writes it."""
    median = sorted(rounds)[len(rounds) // 2]
    return {"tau": tau, "tokens_per_s": 100.0 * median, "speedup_vs_ar": median, "speedup_vs_ar_rounds": rounds,
            "speedup_vs_ar_spread": [min(rounds), max(rounds)], "speedup_over_tau": median / tau if tau else None,
            "matches_ar": True, "mismatches": 0, "near_tie_mismatches": 0}


def _results(methods: dict, machine=None, categories=("chat",)) -> dict:
    for r in methods.values():
        r["per_category"] = {name: dict(r) for name in categories}
    return {"methods": methods, "categories": list(categories), "rounds": 3,
            "machine": machine or {"cores": 8, "load_mean": 1.0, "load_max": 2.0}}


def _row(table: str, spec: str) -> list[str]:
    line = next(line for line in table.splitlines() if line.startswith(f"| {spec} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_steady_plausible_timings_raise_no_warning():
    results = _results({"ar": _entry(1.0, [1.0, 1.0, 1.0]), "pld": _entry(1.5, [1.30, 1.32, 1.35])})
    assert timing_warnings(results) == ([], set())
    table = markdown_table(results)
    assert "WARNING" not in table and "!" not in table
    assert _row(table, "pld")[3:5] == ["1.32", "1.30-1.35"]


def test_a_wide_spread_is_a_warning_and_marks_the_ratio():
    results = _results({"ar": _entry(1.0, [1.0, 1.0, 1.0]), "pld": _entry(1.5, [1.0, 1.3, 1.4])})
    warnings, flagged = timing_warnings(results)
    assert any(w.startswith("pld: speed-up 1.30x varies 1.00-1.40x over 3 rounds") for w in warnings)
    assert flagged == {("pld", None), ("pld", "chat")}
    table = markdown_table(results)
    assert table.startswith("WARNING: pld: speed-up 1.30x varies")
    assert _row(table, "pld")[3] == "1.30 !"
    assert "Per category" not in table  # one category: its table would repeat the one above
    table = markdown_table(_results({"ar": _entry(1.0, [1.0, 1.0, 1.0]), "pld": _entry(1.5, [1.0, 1.3, 1.4])},
                                    categories=("chat", "code")))
    assert "Per category" in table and "| pld | 1.50 / 1.30 ! | 1.50 / 1.30 ! |" in table  # each category's cell


def test_a_drafter_faster_than_its_tau_is_impossible_and_flagged():
    """The issue's probe at tau 1.17 and 1.88x AR."""
    results = _results({"ar": _entry(1.0, [1.0, 1.0, 1.0]), "probe:bc=10": _entry(1.17, [1.87, 1.88, 1.89])})
    warnings, flagged = timing_warnings(results)
    assert warnings[0] == ("probe:bc=10: speed-up 1.88x at tau 1.17: speed-up / tau 1.61 > 1 + spread 0.01 is "
                           "impossible (a verification step costs at least an AR step): AR's step is not the fastest "
                           "path on this target")
    assert flagged == {("probe:bc=10", None), ("probe:bc=10", "chat")}
    table = markdown_table(results)
    assert _row(table, "probe:bc=10")[3] == "1.88 !"
    # an old summary (no rounds, no machine) is checked too, and no 1.88 stands bare anywhere
    old = {k: v for k, v in results.items() if k not in ("rounds", "machine")}
    assert timing_warnings(old)[1] == flagged
    rows = [line for line in markdown_table(old).splitlines() if line.startswith("|")]
    assert all("1.88 !" in line or "1.88" not in line for line in rows)


def test_speed_up_over_tau_within_the_measured_spread_is_not_flagged_but_beyond_it_is():
    inside = _results({"ar": _entry(1.0, [1.0, 1.0, 1.0]), "pld": _entry(1.5, [1.48, 1.52, 1.56])})  # 1.01 <= 1.05
    assert timing_warnings(inside) == ([], set())
    one_round = _results({"ar": _entry(1.0, [1.0]), "pld": _entry(1.5, [1.52])})  # no spread measured: exact bound
    assert ("pld", None) in timing_warnings(one_round)[1]


def test_a_step_cheaper_than_ar_s_step_is_flagged():
    cheap, fair = _entry(1.5, [1.30, 1.32, 1.35]), _entry(1.5, [1.30, 1.32, 1.35])
    for entry, cost in ((cheap, 0.86), (fair, 1.12)):
        entry.update(step_cost_vs_ar=cost, mean_forward_tokens=3.0)
    results = _results({"ar": _entry(1.0, [1.0, 1.0, 1.0]), "pld": cheap, "probe": fair})
    warnings, flagged = timing_warnings(results)
    assert warnings[0].startswith("pld: its target step (3.0 rows a call) costs 0.86x AR's 1-row step (< 1 - spread 0.04)")
    assert flagged == {("pld", None), ("pld", "chat")}
    table = markdown_table(results)
    assert "step cost vs AR" in table and _row(table, "pld")[8] == "0.86 !" and _row(table, "probe")[8] == "1.12"


def test_a_baseline_faster_than_ar_is_flagged():
    """AR on stock kernels or transformers' generate beating mtpkit's AR: every speed-up is inflated."""
    results = _results({"ar": _entry(1.0, [1.0, 1.0, 1.0]), "ar_stock": _entry(1.0, [1.06, 1.07, 1.08]),
                        "hf_ar": _entry(None, [0.88, 0.9, 0.91]), "pld": _entry(1.5, [1.30, 1.32, 1.35])})
    warnings, flagged = timing_warnings(results)
    assert warnings[0] == ("ar_stock: AR on torch's stock kernels runs at 1.07x the mtpkit AR baseline (> 1 + spread "
                           "0.02): the baseline is not the fastest this machine allows, so every speed-up vs AR is "
                           "inflated")
    assert flagged == {("ar_stock", None), ("ar_stock", "chat")}  # hf_ar at 0.90x: AR is faster
    table = markdown_table(results)
    assert "AR baseline: 100.0 tokens/s = 1.11x transformers' generate (hf_ar), 0.93x AR on stock kernels" in table
    results["methods"]["hf_ar"] = _entry(None, [1.2, 1.2, 1.2])
    results["methods"]["hf_ar"]["per_category"] = {"chat": dict(results["methods"]["hf_ar"])}
    assert ("hf_ar", None) in timing_warnings(results)[1]


def test_a_busy_machine_marks_every_speed_up_but_ar():
    results = _results({"ar": _entry(1.0, [1.0, 1.0, 1.0]), "pld": _entry(1.5, [1.30, 1.32, 1.35])},
                       machine={"cores": 2, "load_mean": 3.5, "load_max": 4.0})
    warnings, flagged = timing_warnings(results)
    assert warnings == ["machine busy: load average 3.50 (max 4.00) over the run exceeds its 2 cores + 0.5; every "
                        "speed-up is distorted by other processes"]
    # the bench's own 2 threads on 2 cores, plus kernel threads: not busy
    idle = _results({"ar": _entry(1.0, [1.0, 1.0, 1.0]), "pld": _entry(1.5, [1.30, 1.32, 1.35])},
                    machine={"cores": 2, "load_mean": 2.03, "load_max": 2.24})
    assert timing_warnings(idle) == ([], set())
    assert flagged == {("pld", None), ("pld", "chat")}
    assert _row(markdown_table(results), "pld")[3] == "1.32 !"


def test_the_plot_title_carries_the_warning(tmp_path, monkeypatch):
    import matplotlib.figure

    titles = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda fig, *a, **k: titles.extend(ax.get_title() for ax in fig.axes))
    clean = _results({"ar": _entry(1.0, [1.0, 1.0, 1.0]), "pld": _entry(1.5, [1.30, 1.32, 1.35])})
    write_plot(clean, tmp_path / "a.png")
    assert not any("WARNING" in t for t in titles) and any("median of 3 rounds" in t for t in titles)
    titles.clear()
    write_plot(_results({"ar": _entry(1.0, [1.0, 1.0, 1.0]), "pld": _entry(1.1, [1.3, 1.3, 1.3])}), tmp_path / "b.png")
    assert any(t.startswith("WARNING: 2 timing warning(s)") for t in titles)
