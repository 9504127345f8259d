"""Which timings of a bench run cannot be trusted, and the mark printed beside their ratios.

`timing_warnings` names every speed-up that cannot be trusted: a spread over the rounds wider
than SPREAD_LIMIT of its median, a drafter whose speed-up / tau exceeds 1 + its spread or whose
k-row target step costs less than AR's 1-row step beyond the spread (AR is then not the fastest
path on this target), a baseline (AR on stock kernels, transformers' generate) faster than AR
beyond the spread, or a machine busier than its cores.
"""

from __future__ import annotations

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
MARK = "!"  # appended to every printed ratio that a warning applies to


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
