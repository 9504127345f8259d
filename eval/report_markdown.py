"""The bench's results as markdown: the tables (totals, per cycle, per category, per dtype),
the baseline line and the verdict on each method. The formatter reads only summary keys, so
eval/tables.py renders the summaries kept in docs/results/*.json with it too."""

from __future__ import annotations

from pathlib import Path

from mtpkit.eval.report_warnings import BASELINES, MARK, timing_warnings
from mtpkit.models.atomic_write import write_atomic


def fmt(x, digits=2):
    return "-" if x is None else (f"{x:.{digits}f}" if isinstance(x, float) else str(x))


def ratio_cell(x, flagged: bool) -> str:
    """A speed-up as printed: never bare when a timing warning applies to it."""
    return fmt(x) + (f" {MARK}" if flagged and x is not None else "")


def _spread_cell(r: dict) -> str:
    spread = r.get("speedup_vs_ar_spread")
    if not spread or len(r.get("speedup_vs_ar_rounds", spread)) < 2:
        return "-"
    return f"{spread[0]:.2f}-{spread[1]:.2f}"


def match_cell(r: dict) -> str:
    if r["matches_ar"] is None:
        return "n/a (sampling)"
    if r["matches_ar"]:
        return "yes"
    return f"no: {r['mismatches']} differ, {r['near_tie_mismatches']} at near-ties"


def baseline_line(results: dict) -> str | None:
    """AR's tokens/s against the other baselines of the same run (transformers' generate on the
    stock model, the mtpkit decoder on torch's stock kernels), or None if neither ran."""
    methods = results["methods"]
    ar = methods.get("ar")
    others = [(spec, label) for spec, label in (("hf_ar", "transformers' generate (hf_ar)"),
                                                ("hf_ar:compile=1", "its static cache + torch.compile (hf_ar:compile=1)"),
                                                ("ar_stock", "AR on stock kernels (ar_stock)")) if spec in methods]
    if ar is None or not others:
        return None
    parts = [f"{1 / methods[spec]['speedup_vs_ar']:.2f}x {label}" for spec, label in others]
    return f"AR baseline: {ar['tokens_per_s']:.1f} tokens/s = " + ", ".join(parts) + " (median of the per-round ratios)"


def verdict_lines(results: dict) -> list[str]:
    """What each method of the run is, which one is fastest, and why each drafter lands where it
    does: its speed-up vs AR is the tokens it gains a step (tau) over its step's cost in AR steps."""
    from mtpkit.models.registry import METHODS

    methods = results["methods"]
    if not methods:
        return []
    best = max(methods, key=lambda spec: methods[spec]["speedup_vs_ar"])
    lines = [f"Fastest here: {best} at {methods[best]['speedup_vs_ar']:.2f}x AR's tokens/s."]
    learned = [spec for spec in methods if spec.partition(":")[0] in METHODS and METHODS[spec.partition(":")[0]].head_files]
    if learned:
        top = max(learned, key=lambda spec: methods[spec]["speedup_vs_ar"])
        speedup = methods[top]["speedup_vs_ar"]
        spread = methods[top].get("speedup_vs_ar_spread")
        lines.append(f"The fastest trained head, {top}, runs at {speedup:.2f}x AR"
                     + (f" ({spread[0]:.2f}-{spread[1]:.2f} over the rounds)" if spread and results.get("rounds", 1) > 1 else "")
                     + (": at or above AR here." if speedup >= 1 else
                        ": no trained head reaches AR's tokens/s in this run (see its line below for why)."))
    for spec, r in methods.items():
        name = spec.partition(":")[0]
        what = METHODS[name].summary if name in METHODS else name
        line = f"- {spec}: {what}"
        if r.get("tau") is not None and name not in BASELINES and r["speedup_vs_ar"]:
            cost = r["tau"] / r["speedup_vs_ar"]
            line += (f"; {r['tau']:.2f} tokens a step at {cost:.2f}x AR's time a step = {r['speedup_vs_ar']:.2f}x AR"
                     + ("" if r["speedup_vs_ar"] >= 1 else ": it accepts too few drafts to pay for its wider step"))
        elif name != "ar":
            line += f"; {r['speedup_vs_ar']:.2f}x AR"
        lines.append(line)
    return lines


def write_markdown(results: dict, path: Path) -> str:
    """The bench's results as markdown: the timing warnings, what each method is and which one is
    fastest here and why (`verdict_lines`), then the tables."""
    text = markdown_table(results, lead=verdict_lines(results))
    write_atomic(path, text)
    return text


def markdown_table(results: dict, per_cycle: bool = True, lead: list[str] = ()) -> str:
    """The bench's tables: totals per method, the per-cycle (MTPC paper) metrics unless
    `per_cycle` is false, and tau / speed-up per category, after the timing warnings and the
    `lead` lines (a verdict on the timings comes after the warnings about them). It reads only
    summary keys, so it also formats the summaries that eval/tables.py keeps in docs/results/*.json."""
    stock = any("speedup_vs_stock_ar" in r for r in results["methods"].values())
    rounds = results.get("rounds", 1)
    spread = rounds > 1
    warnings, flagged = timing_warnings(results)
    lines = []
    if warnings:
        lines += [f"WARNING: {w}" for w in warnings]
        lines += [f"(speed-ups marked {MARK} are not to be trusted)", ""]
    if lead:
        lines += list(lead) + [""]
    if "rounds" in results:
        lines += [f"Timings: median over {rounds} round(s)" + (", spread = min-max over the rounds" if spread else
                  " (one round: the spread is unknown; --rounds 3 or more measures it)"), ""]
    baseline = baseline_line(results)
    if baseline:
        lines += [baseline, ""]
    cost = any("step_cost_vs_ar" in r for r in results["methods"].values())
    rows = any("x_rows" in r for r in results["methods"].values())
    floor = any("x_floor" in r for r in results["methods"].values())
    reads = any("host_reads_step" in r for r in results["methods"].values())
    loop = any("x_loop" in r for r in results["methods"].values())
    lines += ["| method | tau | tokens/s | speed-up vs AR | " + ("spread | " if spread else "")
              + ("vs stock AR | " if stock else "")
              + "speed-up / tau | step ms | target ms/call | " + ("step cost vs AR | " if cost else "")
              + ("x rows | " if rows else "") + ("x rows, own work apart | " if loop else "")
              + ("x floor | " if floor else "") + ("host reads | " if reads else "")
              + "decoder overhead | matches AR |",
              "|---|---|---|---|---|---|---|---|---|" + ("---|" if spread else "") + ("---|" if stock else "")
              + ("---|" if cost else "") + ("---|" if rows else "") + ("---|" if loop else "")
              + ("---|" if floor else "") + ("---|" if reads else "")]
    for spec, r in results["methods"].items():
        bad = (spec, None) in flagged
        lines.append(f"| {spec} | {fmt(r['tau'])} | {fmt(r['tokens_per_s'], 1)} | {ratio_cell(r['speedup_vs_ar'], bad)} | "
                     + (f"{_spread_cell(r)} | " if spread else "")
                     + (f"{ratio_cell(r.get('speedup_vs_stock_ar'), bad)} | " if stock else "")
                     + f"{ratio_cell(r.get('speedup_over_tau'), bad)} | {fmt(r.get('mean_step_ms'), 1)} | "
                     f"{fmt(r.get('target_ms_per_call'), 1)} | "
                     + (f"{ratio_cell(r.get('step_cost_vs_ar'), bad)} | " if cost else "")
                     + (f"{fmt(r.get('x_rows'))} | " if rows else "") + (f"{fmt(r.get('x_loop'))} | " if loop else "")
                     + (f"{fmt(r.get('x_floor'))} | " if floor else "")
                     + (f"{fmt(r.get('host_reads_step'), 2)} | " if reads else "")
                     + f"{fmt(r.get('decoder_overhead_share'), 3)} | {match_cell(r)} |")
    if per_cycle:
        lines += ["", "Per cycle (MTPC paper metrics: mu_lat = seconds per target call, mu_acc = accepted draft "
                  "tokens per call, max = tokens/s if every drafted token were accepted):", "",
                  "| method | mu_lat (s) | mu_acc | tokens/s | max tokens/s | speed-up vs AR |", "|---|---|---|---|---|---|"]
        for spec, r in results["methods"].items():
            if r.get("mu_lat") is not None:
                lines.append(f"| {spec} | {r['mu_lat']:.4f} | {r['mu_acc']:.2f} | {r['tokens_per_s']:.1f} | "
                             f"{r['max_tokens_per_s']:.1f} | {ratio_cell(r['speedup_vs_ar'], (spec, None) in flagged)} |")
    if len(results["categories"]) == 1:  # one category's table would repeat the one above
        return "\n".join(lines) + "\n"
    lines += ["", "Per category (tau / speed-up vs AR):", "",
              "| method | " + " | ".join(results["categories"]) + " |",
              "|---|" + "---|" * len(results["categories"])]
    for spec, r in results["methods"].items():
        cells = [f"{fmt(c['tau'])} / {ratio_cell(c['speedup_vs_ar'], (spec, name) in flagged)}"
                 for name, c in ((name, r["per_category"][name]) for name in results["categories"])]
        lines.append(f"| {spec} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def table_problem(results) -> str | None:
    """What keeps `markdown_table` from tabling `results` (a results.json read from a file), as
    one phrase naming the key ("no 'methods'", "no 'methods.ar.tau'", "'categories' is not a
    list"), or None: a reader checks a file with it before it makes anything of it."""
    if not isinstance(results, dict):
        return f"a {type(results).__name__}, not a JSON object"
    if not isinstance(results.get("methods"), dict) or not isinstance(results.get("categories"), list):
        key = "methods" if not isinstance(results.get("methods"), dict) else "categories"
        return f"no {key!r}" if key not in results else f"{key!r} is not a {'mapping' if key == 'methods' else 'list'}"
    for spec, r in results["methods"].items():
        if not isinstance(r, dict):
            return f"'methods.{spec}' is not a mapping"
        needed = ["tau", "tokens_per_s", "speedup_vs_ar", "matches_ar"]
        needed += ["mismatches", "near_tie_mismatches"] if r.get("matches_ar") is False else []
        needed += ["mu_acc", "max_tokens_per_s"] if r.get("mu_lat") is not None else []
        for key in needed:
            if key not in r:
                return f"no 'methods.{spec}.{key}'"
        for name in results["categories"]:
            c = (r.get("per_category") or {}).get(name)
            if not isinstance(c, dict):
                return f"no 'methods.{spec}.per_category.{name}'"
            for key in ("tau", "speedup_vs_ar"):
                if key not in c:
                    return f"no 'methods.{spec}.per_category.{name}.{key}'"
    return None


def dtype_table(by_dtype: dict[str, dict]) -> str:
    """Markdown for one bench run over several target dtypes (`by_dtype`: dtype name -> its
    results): per method, tokens/s in each dtype, each dtype's tokens/s over the first's, tau,
    speed-up vs that dtype's AR and whether greedy outputs match it."""
    names = list(by_dtype)
    head = ["method"] + [f"{d} tok/s" for d in names] + [f"{d} / {names[0]}" for d in names[1:]] \
        + [f"{d} tau" for d in names] + [f"{d} vs AR" for d in names] + [f"{d} = AR" for d in names]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for spec in by_dtype[names[0]]["methods"]:
        rows = [by_dtype[d]["methods"][spec] for d in names]
        cells = [spec] + [fmt(r["tokens_per_s"], 1) for r in rows]
        cells += [f"{r['tokens_per_s'] / rows[0]['tokens_per_s']:.2f}x" for r in rows[1:]]
        cells += [fmt(r.get("tau")) for r in rows] + [fmt(r.get("speedup_vs_ar")) for r in rows]
        cells += [match_cell(r) for r in rows]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
