"""Aggregate benchmark runs into results (per method, per category), tables and a plot.

Timing over rounds: the bench repeats every prompt x method `rounds` times. Token statistics
(tau, accept counts, outputs) come from the first round (every round decodes the same tokens);
each timing is the median over rounds, and each speed-up also keeps its min-max spread over the
rounds. `timing_warnings` names every speed-up that cannot be trusted: a spread wider than
SPREAD_LIMIT of its median, a drafter whose speed-up / tau exceeds 1 + its spread or whose
k-row target step costs less than AR's 1-row step beyond the spread (AR is then not the fastest
path on this target), a baseline (AR on stock kernels, transformers' generate) faster than AR
beyond the spread, or a machine busier than its cores.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import torch

from mtpkit.data.jsonl import read_jsonl
from mtpkit.models.atomic_write import write_atomic

TIE_TOLERANCE = 1e-4  # top-2 target logits closer than this: a genuine floating-point near-tie
# (max - min) / median of a speed-up over the rounds above this: the ratio is machine noise
SPREAD_LIMIT = 0.10
# a drafter's step is one target forward over at least the AR step's row on the same target, so
# its speed-up over AR cannot exceed its tau (tokens per step), nor its target step cost less
# than AR's: beyond 1 + the measured spread of the speed-up, AR's own step is not the fastest
# path (or the timing is noise)
# the baselines (AR itself, AR on stock kernels, transformers' generate): compared with AR, not
# checked against tau; a baseline faster than AR beyond the spread is flagged instead
BASELINES = ("ar", "ar_stock", "hf_ar")
# the bench's own threads keep the load average near the core count (2.0 +- a few hundredths on
# an idle 2-core machine, from kernel threads alone): busy = other processes averaging more than
# this many runnable tasks on top of the cores
BUSY_MARGIN = 0.5
# per-round timings reported as their median over the rounds
TIMING = ("seconds", "tokens_per_s", "mean_step_ms", "target_ms_per_call", "decoder_overhead_share", "mu_lat",
          "max_tokens_per_s", "decode_step_ms")
MARK = "!"  # appended to every printed ratio that a warning applies to


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.no_grad()
def explain_mismatch(model, prompt: list[int], ar: list[int], other: list[int]) -> dict:
    """Where `other` leaves AR's greedy output, and whether the target's top-2 logits tie there."""
    j = first_difference(ar, other)
    if j is None or j >= min(len(ar), len(other)):
        return {"position": j, "top2_gap": None, "near_tie": False, "note": "one output is a prefix of the other"}
    ids = torch.tensor([prompt + ar[:j]], device=getattr(model, "device", "cpu"))  # a HF model's device
    logits = model(input_ids=ids).logits[0, -1].float()
    top = logits.topk(2).values
    gap = float(top[0] - top[1])
    return {"position": j, "ar_token": ar[j], "other_token": other[j], "top2_gap": gap,
            "near_tie": gap < TIE_TOLERANCE}


def _aggregate(runs: list[dict], ar_runs: list[dict], mismatches: list[dict] | None) -> dict:
    tokens = sum(len(r["tokens"]) for r in runs)
    seconds = sum(r["seconds"] for r in runs)
    ar_tps = sum(len(r["tokens"]) for r in ar_runs) / sum(r["seconds"] for r in ar_runs)
    tps = tokens / seconds
    out = {"prompts": len(runs), "new_tokens": tokens, "seconds": round(seconds, 3),
           "tokens_per_s": round(tps, 3), "speedup_vs_ar": round(tps / ar_tps, 4)}
    if "target_calls" in runs[0]:  # mtpkit decoder runs (HF generate reports no calls)
        calls = sum(r["target_calls"] for r in runs)
        depth = max(len(r["accept_counts"]) for r in runs)
        accept = [sum(r["accept_counts"][d] for r in runs if d < len(r["accept_counts"])) for d in range(depth)]
        target_s = sum(r["target_seconds"] for r in runs)
        out.update(tau=round(tokens / calls, 4), target_calls=calls, accept_counts=accept,
                   speedup_over_tau=round(out["speedup_vs_ar"] / (tokens / calls), 4),
                   mean_step_ms=round(1000 * seconds / calls, 2),
                   target_ms_per_call=round(1000 * target_s / calls, 2),
                   decoder_overhead_share=round(1 - target_s / seconds, 4),
                   mean_forward_tokens=round(sum(r["forward_tokens"] for r in runs) / calls, 2),
                   mean_draft_nodes=round(sum(r["draft_nodes"] for r in runs) / calls, 2),
                   # the MTPC paper's metrics: seconds per cycle, accepted draft tokens per cycle,
                   # and the throughput if every drafted token were accepted at the same latency
                   mu_lat=round(seconds / calls, 5), mu_acc=round(sum(accept) / calls, 4),
                   max_tokens_per_s=round(sum(r["draft_nodes"] for r in runs) / seconds, 2))
        decode_calls = calls - sum(r.get("prefill_tokens", 0) > 0 for r in runs)
        if "prefill_seconds" in runs[0] and decode_calls > 0:
            # the steps after the first (prefill): their mean time and rows, what `x_rows` compares
            out.update(decode_step_ms=round(1000 * (seconds - sum(r["prefill_seconds"] for r in runs)) / decode_calls, 3),
                       decode_rows=round((sum(r["forward_tokens"] for r in runs)
                                          - sum(r["prefill_tokens"] for r in runs)) / decode_calls, 2))
    else:
        out.update(tau=None, target_calls=None, accept_counts=None)
    if "target_seconds" in runs[0] and "target_seconds" in ar_runs[0]:
        # a step's target forward (k rows) against AR's (1 row), both in this run
        ar_ms = sum(r["target_seconds"] for r in ar_runs) / sum(r["target_calls"] for r in ar_runs)
        out["step_cost_vs_ar"] = round(out["target_ms_per_call"] / (1000 * ar_ms), 4)
    if mismatches is not None:
        out["matches_ar"] = not mismatches
        out["mismatches"] = len(mismatches)
        out["near_tie_mismatches"] = sum(m["near_tie"] for m in mismatches)
    else:
        out["matches_ar"] = None  # sampling: outputs are random, compare distributions instead
    return out


def _over_rounds(per_round: list[dict]) -> dict:
    """One aggregate from each round's: the first round's token statistics, the median of each
    timing, and the speed-up's median, its per-round values and their [min, max] spread."""
    out = dict(per_round[0])
    for key in TIMING:
        if out.get(key) is not None:
            out[key] = round(statistics.median(r[key] for r in per_round), 5)
    speedups = [r["speedup_vs_ar"] for r in per_round]
    if out.get("step_cost_vs_ar") is not None:
        costs = [r["step_cost_vs_ar"] for r in per_round]
        out["step_cost_vs_ar"] = round(statistics.median(costs), 4)
        out["step_cost_vs_ar_spread"] = [min(costs), max(costs)]
    out["speedup_vs_ar"] = round(statistics.median(speedups), 4)
    out["speedup_vs_ar_rounds"] = speedups
    out["speedup_vs_ar_spread"] = [min(speedups), max(speedups)]
    if out.get("tau"):
        out["speedup_over_tau"] = round(out["speedup_vs_ar"] / out["tau"], 4)
    return out


def summarise(runs: dict[str, list[dict]] | list[dict[str, list[dict]]], prompts: list[dict], model, greedy: bool,
              machine: dict | None = None) -> dict:
    """results["methods"][spec] = totals + per_category + outputs (token ids per prompt).

    `runs` is one round (spec -> runs per prompt) or a list of rounds; `machine` (cores, load
    average over the run) goes into results["machine"] and the load warning."""
    rounds = [runs] if isinstance(runs, dict) else runs
    runs = rounds[0]
    ar = runs["ar"]
    categories = sorted({p["category"] for p in prompts})
    methods = {}
    for spec, spec_runs in runs.items():
        mismatch_by_prompt = {}
        if greedy:
            for i, (run, ref) in enumerate(zip(spec_runs, ar)):
                if run["tokens"] != ref["tokens"]:
                    info = explain_mismatch(model, prompts[i]["ids"], ref["tokens"], run["tokens"])
                    mismatch_by_prompt[i] = {"prompt": prompts[i]["id"], **info}
        pick = lambda idx: [mismatch_by_prompt[i] for i in idx if i in mismatch_by_prompt] if greedy else None
        entry = _over_rounds([_aggregate(r[spec], r["ar"], pick(range(len(prompts)))) for r in rounds])
        entry["per_category"] = {}
        for cat in categories:
            idx = [i for i, p in enumerate(prompts) if p["category"] == cat]
            entry["per_category"][cat] = _over_rounds([_aggregate([r[spec][i] for i in idx], [r["ar"][i] for i in idx],
                                                                  pick(idx)) for r in rounds])
        if "ar_stock" in runs:  # the packed target's AR and the stock kernels' AR: speed-up vs both
            vs_stock = [_aggregate(r[spec], r["ar_stock"], None)["speedup_vs_ar"] for r in rounds]
            entry["speedup_vs_stock_ar"] = round(statistics.median(vs_stock), 4)
            entry["speedup_vs_stock_ar_spread"] = [min(vs_stock), max(vs_stock)]
        entry["mismatch_details"] = list(mismatch_by_prompt.values())
        entry["outputs"] = {p["id"]: {"category": p["category"], "prompt_ids": p["ids"], "output_ids": r["tokens"]}
                            for p, r in zip(prompts, spec_runs)}
        methods[spec] = entry
    results = {"methods": methods, "categories": categories, "rounds": len(rounds)}
    if machine is not None:
        results["machine"] = machine
    results["warnings"] = timing_warnings(results)[0]
    return results


def _spread_of(r: dict, key: str = "speedup_vs_ar") -> float | None:
    """(max - min) / median of a speed-up over the rounds; None with fewer than 2 rounds."""
    spread = r.get(f"{key}_spread")
    if not spread or len(r.get(f"{key}_rounds", spread)) < 2 or not r.get(key):
        return None
    return (spread[1] - spread[0]) / r[key]


def timing_warnings(results: dict) -> tuple[list[str], set]:
    """(warning lines, flagged) for a results dict (new or old summaries alike): a line per
    untrustworthy timing, and the (spec, category or None) of every speed-up one applies to."""
    lines, flagged = [], set()
    machine = results.get("machine") or {}
    busy = machine.get("load_mean") is not None and machine["load_mean"] > machine["cores"] + BUSY_MARGIN
    if busy:
        lines.append(f"machine busy: load average {machine['load_mean']:.2f} (max {machine['load_max']:.2f}) over the "
                     f"run exceeds its {machine['cores']} cores + {BUSY_MARGIN}; every speed-up is distorted by other "
                     "processes")
    for spec, r in results["methods"].items():
        name = spec.partition(":")[0]
        for cat, c in [(None, r), *r.get("per_category", {}).items()]:
            where = spec if cat is None else f"{spec} [{cat}]"
            reasons = []
            spread = _spread_of(c)
            tol = spread or 0.0  # how far a ratio may pass its bound: the measured spread (none: exact)
            if spread is not None and spread > SPREAD_LIMIT:
                lo, hi = c["speedup_vs_ar_spread"]
                reasons.append(f"speed-up {c['speedup_vs_ar']:.2f}x varies {lo:.2f}-{hi:.2f}x over "
                               f"{len(c['speedup_vs_ar_rounds'])} rounds ({spread:.0%} of its median > {SPREAD_LIMIT:.0%})")
            if name not in BASELINES and c.get("tau") and c["speedup_vs_ar"] / c["tau"] > 1 + tol:
                reasons.append(f"speed-up {c['speedup_vs_ar']:.2f}x at tau {c['tau']:.2f}: speed-up / tau "
                               f"{c['speedup_vs_ar'] / c['tau']:.2f} > 1 + spread {tol:.2f} is impossible (a verification "
                               "step costs at least an AR step): AR's step is not the fastest path on this target")
            if name not in BASELINES and c.get("step_cost_vs_ar") is not None and c["step_cost_vs_ar"] < 1 - tol:
                reasons.append(f"its target step ({c.get('mean_forward_tokens', '?')} rows a call) costs "
                               f"{c['step_cost_vs_ar']:.2f}x AR's 1-row step (< 1 - spread {tol:.2f}): AR's step is "
                               "not the fastest path on this target, so the speed-up is inflated")
            if cat is None and r.get("other_backbone"):
                reasons.append("its head runs on a backbone other than the one it was trained on "
                               "(allow_other_backbone=1): not a result of this head")
            if name in BASELINES and spec != "ar" and c["speedup_vs_ar"] > 1 + tol:
                what = {"hf_ar": "transformers' generate", "ar_stock": "AR on torch's stock kernels"}.get(
                    name, f"AR on another step ({spec})")
                reasons.append(f"{what} runs at {c['speedup_vs_ar']:.2f}x the mtpkit AR baseline (> 1 + spread "
                               f"{tol:.2f}): the baseline is not the fastest this machine allows, so every speed-up "
                               "vs AR is inflated")
            if cat is None:
                stock_spread = _spread_of(r, "speedup_vs_stock_ar")
                if stock_spread is not None and stock_spread > SPREAD_LIMIT:
                    lo, hi = r["speedup_vs_stock_ar_spread"]
                    reasons.append(f"speed-up vs stock AR varies {lo:.2f}-{hi:.2f}x over the rounds")
            lines += [f"{where}: {reason}" for reason in reasons]
            if reasons or (busy and spec != "ar"):
                flagged.add((spec, cat))
    return lines, flagged


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


def write_markdown(results: dict, path: Path) -> str:
    """The bench's results as markdown: the tables, then what each method is and which one is
    fastest here and why (`verdict_lines`)."""
    text = markdown_table(results) + "\n" + "\n".join(verdict_lines(results)) + "\n"
    write_atomic(path, text)
    return text


def markdown_table(results: dict, per_cycle: bool = True) -> str:
    """The bench's tables: totals per method, the per-cycle (MTPC paper) metrics unless
    `per_cycle` is false, and tau / speed-up per category. It reads only summary keys, so it also
    formats the summaries that eval/tables.py keeps in docs/results/*.json."""
    stock = any("speedup_vs_stock_ar" in r for r in results["methods"].values())
    rounds = results.get("rounds", 1)
    spread = rounds > 1
    warnings, flagged = timing_warnings(results)
    lines = []
    if warnings:
        lines += [f"WARNING: {w}" for w in warnings]
        lines += [f"(speed-ups marked {MARK} are not to be trusted)", ""]
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
    lines += ["| method | tau | tokens/s | speed-up vs AR | " + ("spread | " if spread else "")
              + ("vs stock AR | " if stock else "")
              + "speed-up / tau | step ms | target ms/call | " + ("step cost vs AR | " if cost else "")
              + ("x rows | " if rows else "") + ("x floor | " if floor else "") + ("host reads | " if reads else "")
              + "decoder overhead | matches AR |",
              "|---|---|---|---|---|---|---|---|---|" + ("---|" if spread else "") + ("---|" if stock else "")
              + ("---|" if cost else "") + ("---|" if rows else "") + ("---|" if floor else "")
              + ("---|" if reads else "")]
    for spec, r in results["methods"].items():
        bad = (spec, None) in flagged
        lines.append(f"| {spec} | {fmt(r['tau'])} | {fmt(r['tokens_per_s'], 1)} | {ratio_cell(r['speedup_vs_ar'], bad)} | "
                     + (f"{_spread_cell(r)} | " if spread else "")
                     + (f"{ratio_cell(r.get('speedup_vs_stock_ar'), bad)} | " if stock else "")
                     + f"{ratio_cell(r.get('speedup_over_tau'), bad)} | {fmt(r.get('mean_step_ms'), 1)} | "
                     f"{fmt(r.get('target_ms_per_call'), 1)} | "
                     + (f"{ratio_cell(r.get('step_cost_vs_ar'), bad)} | " if cost else "")
                     + (f"{fmt(r.get('x_rows'))} | " if rows else "") + (f"{fmt(r.get('x_floor'))} | " if floor else "")
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


def match_cell(r: dict) -> str:
    if r["matches_ar"] is None:
        return "n/a (sampling)"
    if r["matches_ar"]:
        return "yes"
    return f"no: {r['mismatches']} differ, {r['near_tie_mismatches']} at near-ties"


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


def write_plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cats = results["categories"] + ["all"]
    specs = list(results["methods"])
    warnings, flagged = timing_warnings(results)
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(cats) * max(1, len(specs)) / 2), 4.5))
    width = 0.8 / len(specs)
    rounds = results.get("rounds", 1)
    speed_title = "wall-clock speed-up vs AR" + (f" (median of {rounds} rounds, bars: min-max)" if rounds > 1 else "")
    for ax, key, title in ((axes[0], "tau", "tau (tokens per target call)"), (axes[1], "speedup_vs_ar", speed_title)):
        for j, spec in enumerate(specs):
            r = results["methods"][spec]
            entries = [r["per_category"][c] if c != "all" else r for c in cats]
            values = [e[key] if e[key] is not None else 0.0 for e in entries]
            xs = [i + j * width for i in range(len(cats))]
            yerr = None
            if key == "speedup_vs_ar" and rounds > 1 and all(e.get("speedup_vs_ar_spread") for e in entries):
                yerr = [[v - e["speedup_vs_ar_spread"][0] for v, e in zip(values, entries)],
                        [e["speedup_vs_ar_spread"][1] - v for v, e in zip(values, entries)]]
            ax.bar(xs, values, width, label=spec, yerr=yerr, capsize=2)
            if key == "speedup_vs_ar":  # a warning's ratio carries its mark on the plot too
                for x, v, c in zip(xs, values, cats):
                    if (spec, None if c == "all" else c) in flagged:
                        ax.annotate(MARK, (x, v), ha="center", va="bottom", color="red", fontsize=9, weight="bold")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([i + width * (len(specs) - 1) / 2 for i in range(len(cats))], cats, rotation=20)
        ax.set_title(title)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=min(len(specs), 7), fontsize=8)
    if warnings:
        axes[1].set_title(f"WARNING: {len(warnings)} timing warning(s) (results.json `warnings`); "
                          f"{MARK} = not to be trusted\n{speed_title}", color="red", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_training_plot(metrics_file: Path, path: Path) -> None:
    """Loss parts, per-mask top-1 accuracy and the simulated tau against the step, from a
    training run's metrics.jsonl (a line that is not a JSON object, e.g. one cut by an
    interruption, is passed over)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [line.value for line in read_jsonl(metrics_file) if isinstance(line.value, dict)]
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "sim_tau" in r]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for key in ("loss", "base_ntp", "base_mtp", "sampler_ntp", "sampler_mtp", "lcm"):
        if any(key in r for r in train):
            axes[0].plot([r["step"] for r in train if key in r], [r[key] for r in train if key in r], label=key)
    axes[0].set_title("losses")
    accs = sorted({k for r in train for k in r if k.startswith("acc_m")}, key=lambda k: int(k[5:]))
    for key in accs:
        axes[1].plot([r["step"] for r in train if key in r], [r[key] for r in train if key in r], label=key)
    axes[1].set_title("top-1 accuracy of mask i (base head)")
    axes[2].plot([r["step"] for r in evals], [r["sim_tau"] for r in evals], marker="o")
    axes[2].set_title("simulated tau (held-out prompts)")
    for ax in axes:
        ax.set_xlabel("step")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_tradeoff_plot(results: dict, path: Path, title: str = "") -> None:
    """The MTPC paper's Figure 1: tokens per cycle against seconds per cycle for every decoder
    method, with dotted iso-throughput lines (tokens/s), so the expressiveness/latency trade-off
    of each design reads off directly (up-left is faster)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = {spec: (r["mu_lat"], r["tau"]) for spec, r in results["methods"].items() if r.get("mu_lat")}
    if not points:
        return
    fig, ax = plt.subplots(figsize=(7, 5))
    xs = [x for x, _ in points.values()]
    x_max = max(xs) * 1.15
    tps = sorted(r["tokens_per_s"] for r in results["methods"].values() if r.get("mu_lat"))
    for level in sorted({round(t, -1) or t for t in tps}):
        ax.plot([0, x_max], [0, level * x_max], ":", color="grey", linewidth=0.8)
        ax.annotate(f"{level:g} tok/s", (x_max, level * x_max), fontsize=7, color="grey")
    for spec, (x, y) in points.items():
        ax.scatter([x], [y])
        ax.annotate(spec, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlim(0, x_max)
    ax.set_ylim(0, max(y for _, y in points.values()) * 1.2)
    ax.set_xlabel("mu_lat: seconds per cycle (one target call)")
    ax.set_ylabel("tokens per cycle (accepted drafts + free tokens)")
    ax.set_title(title or "expressiveness vs latency (dotted: iso-throughput)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
