"""Aggregate benchmark runs into results: per method and per category, over the rounds.

Timing over rounds: the bench repeats every prompt x method `rounds` times. Token statistics
(tau, accept counts, outputs) come from the first round (every round decodes the same tokens);
each timing is the median over rounds, and each speed-up also keeps its min-max spread over the
rounds. The rest of the report lives beside this module and is re-exported here for its callers:
eval/report_warnings.py (which timings cannot be trusted), eval/report_markdown.py (tables and
verdicts) and eval/report_plots.py (plots).
"""

from __future__ import annotations

import statistics

import torch

from mtpkit.eval.report_markdown import (baseline_line, dtype_table, fmt, markdown_table, match_cell, ratio_cell,
                                         table_problem, verdict_lines, write_markdown)
from mtpkit.eval.report_plots import write_plot, write_tradeoff_plot, write_training_plot
from mtpkit.eval.report_warnings import BASELINES, BUSY_MARGIN, MARK, SPREAD_LIMIT, timing_warnings

__all__ = ["BASELINES", "BUSY_MARGIN", "FLOOR_VERSION", "MARK", "SPREAD_LIMIT", "TIE_TOLERANCE", "TIMING",
           "baseline_line", "dtype_table", "explain_mismatch", "first_difference", "fmt", "markdown_table", "match_cell",
           "ratio_cell", "summarise", "table_problem", "timing_warnings", "verdict_lines", "write_markdown", "write_plot",
           "write_tradeoff_plot", "write_training_plot"]

FLOOR_VERSION = 2
"""The statistic `x_rows` and `x_loop` are (`mtpkit.eval.step_rows`); bumped when it changes:
results of another (older) version are rendered without them (eval/tables.py, which reads this
constant here, not from the runtime's modules). 2: each shape's median step over the median of its
forwards at the decode's own cache length, the draft redone before each (`decode_floors`)."""
TIE_TOLERANCE = 1e-4  # top-2 target logits closer than this: a genuine floating-point near-tie
# per-round timings reported as their median over the rounds
TIMING = ("seconds", "tokens_per_s", "mean_step_ms", "target_ms_per_call", "decoder_overhead_share", "draft_share",
          "mu_lat", "max_tokens_per_s", "decode_step_ms", "decode_draft_ms")


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
        if "draft_seconds" in runs[0]:  # the drafter's own work (its heads, its draws): the rest is the loop's
            draft_s = sum(r["draft_seconds"] for r in runs)
            out["draft_share"] = round(draft_s / seconds, 4)
            if decode_calls > 0:
                out["decode_draft_ms"] = round(1000 * (draft_s - sum(r["prefill_draft_seconds"] for r in runs))
                                               / decode_calls, 3)
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
