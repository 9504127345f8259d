"""The report of the gated-LoRA ablations (`eval/ablate.py`, step 5).

- OUT/ablation.json (everything), OUT/ablation.md (the table in the order of the paper's
  figures: sampler, LCM, gated vs plain LoRA, linear vs quadratic, k; each row's tau, tokens/s,
  speed-up vs AR from the bench, and whether the paper's ordering holds in these numbers) and
  OUT/ablation.png (tau per comparison). The table is printed too.
- Training curves, from each variant's metrics.jsonl: sim_tau at every evaluation (the
  trainer's --eval-every) against the optimizer step and against the training seconds spent
  until then (evaluations excluded), and each run's NTP tokens/s: a table in OUT/ablation.md and
  OUT/curves.png (sim_tau vs step, sim_tau vs training seconds), e.g. the paper's step against
  the cheaper one at equal sim_tau per step.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from mtpkit.data.jsonl import read_jsonl
from mtpkit.eval.report import MARK, fmt, match_cell, ratio_cell, timing_warnings

GROUPS = ("(1) sampler on/off", "(2) LCM on/off", "(3) gated vs plain LoRA", "(4) linear vs quadratic", "(5) k (masks)",
          "other")
FACTOR_GROUP = {"sampler": GROUPS[0], "lcm_weight": GROUPS[1], "gated": GROUPS[2], "k": GROUPS[4]}
"""the setting two variants differ in -> the paper's comparison (any other setting: `other`)"""


def settings(cfg: dict) -> dict:
    """The resolved config as flat settings (the model's fields beside the run's), without the output dir."""
    flat = {k: v for k, v in cfg.items() if k not in ("model", "output_dir")}
    flat.update(cfg.get("model", {}))
    return flat


def higher(a: dict, b: dict, key: str = "tau") -> str:
    """'yes (a > b)' when row a's value beats row b's, as the paper found."""
    x, y = a.get(key), b.get(key)
    if x is None or y is None:
        return "-"
    return f"yes ({x:.2f} > {y:.2f})" if x > y else f"no ({x:.2f} <= {y:.2f})"


def comparisons(configs: dict[str, dict], rows: dict[tuple[str, str], dict], quality: dict | None) -> list[dict]:
    """The table's rows in the paper's order: pairs of variants whose resolved configs differ in one
    setting (sampler, LCM weight, gating, k, or another), linear vs quadratic per variant, and
    `full` at k=2. Each pair: the reference row, then the ablated one with `holds`; rows in no
    pair come last, under `other`."""
    pairs = []  # (group, reference (variant, decoding), ablated, holds(ref row, ablated row) or None)
    flat = {n: settings(c) for n, c in configs.items()}
    for a, b in itertools.combinations(configs, 2):
        diff = [k for k in flat[a].keys() | flat[b].keys() if flat[a].get(k) != flat[b].get(k)]
        if len(diff) != 1:
            continue
        key = diff[0]
        group = FACTOR_GROUP.get(key, "other")
        if key == "lcm_weight" and min(flat[a][key], flat[b][key]) != 0:
            group = "other"
        if group == "other":
            pairs.append((group, (a, "quadratic"), (b, "quadratic"), None))
            continue
        on, off = (a, b) if flat[a][key] > flat[b][key] else (b, a)  # sampler on, LCM on, gated, more masks
        pairs.append((group, (on, "quadratic"), (off, "quadratic"), None if key == "gated" else higher))
    for name in configs:
        if (name, "linear") in rows:
            pairs.append((GROUPS[3], (name, "quadratic"), (name, "linear"), higher))
        if (name, "quadratic, k=2") in rows:
            pairs.append((GROUPS[4], (name, "quadratic"), (name, "quadratic, k=2"), higher))
    table = []
    for group, ref, ablated, rule in sorted(pairs, key=lambda p: GROUPS.index(p[0])):
        r, x = rows[ref], rows[ablated]
        if group == GROUPS[2]:  # Figure 6: gated keeps the base's NTP outputs exactly, plain LoRA moves them
            gated, plain = (ref, ablated) if configs[ref[0]]["model"].get("gated", True) else (ablated, ref)
            holds = gated_holds(quality, gated[0], plain[0])
        else:
            holds = rule(r, x) if rule else "n/a (no claim in the paper)"
        if not (table and table[-2]["group"] == group and table[-2]["spec"] == r["spec"]):  # not twice in a row
            table.append({"group": group, **r, "holds": "(reference)"})
        table.append({"group": group, **x, "holds": holds})
    shown = {row["spec"] for row in table}
    table += [{"group": "other", **r, "holds": "n/a (nothing to compare with)"} for r in rows.values()
              if r["spec"] not in shown]
    return table


def gated_holds(quality: dict | None, gated: str, plain: str) -> str:
    if quality is None:
        return "-"
    g, p = quality["variants"][gated], quality["variants"][plain]
    ok = g["max_abs_logit_diff"] == 0 and p["ce"] > quality["base_ce"]
    return (f"{'yes' if ok else 'no'} (gated = base exactly: {'yes' if g['max_abs_logit_diff'] == 0 else 'no'}; "
            f"plain NTP CE {p['ce']:.3f} vs base {quality['base_ce']:.3f})")


def markdown(report: dict, table: list[dict], results: dict) -> str:
    warnings, flagged = timing_warnings(results)
    quality = report["quality"]
    q = quality["variants"] if quality else {}
    lines = ["# Gated-LoRA ablations (Samragh et al., arXiv:2507.11851, Sec. 3.1 and 3.3)", "",
             f"Recipe {report['recipe']}, {report['max_steps']} steps per variant on {report['data']} "
             f"(seed {report['seed']}); one bench run, {results.get('rounds', 1)} round(s), over "
             f"{' '.join(report['bench_data'])}.", "", f"Command: `{report['command']}`", ""]
    lines += [f"WARNING: {w}" for w in warnings] + ([f"(speed-ups marked {MARK} are not to be trusted)", ""]
                                                  if warnings else [])
    lines += ["| comparison | variant | decoding | tau | tokens/s | speed-up vs AR | matches AR | NTP CE | "
              "paper's ordering holds here? |", "|---|---|---|---|---|---|---|---|---|"]
    plain = set()
    for row in table:
        name = row["variant"]
        if not report["variants"][name]["gated"]:
            plain.add(name)
        r = results["methods"][row["spec"]]
        lines.append(f"| {row['group']} | {name}{' †' if name in plain else ''} | {row['decoding']} | "
                     f"{fmt(r['tau'])} | {fmt(r['tokens_per_s'], 1)} | "
                     f"{ratio_cell(r['speedup_vs_ar'], (row['spec'], None) in flagged)} | {match_cell(r)} | "
                     f"{fmt(q.get(name, {}).get('ce'), 3)} | {row['holds']} |")
    if plain:
        lines += ["", "† LoRA on at every position: its drafts are verified by the LoRA-changed model, not the base, "
                  "so its outputs differ from AR (not lossless) and its tau is not a lossless head's."]
    if quality:
        held = "the training data (not held out)" if quality["is_training_data"] else "held-out records"
        lines += ["", "## Base-model quality (Figure 6)", "",
                  f"NTP cross-entropy (nats per assistant token) on {quality['records']} records, {quality['tokens']} "
                  f"tokens of {quality['data']}: {held}.", "",
                  "| model | NTP CE | CE - base CE | max abs logit diff vs base | = base exactly |",
                  "|---|---|---|---|---|",
                  f"| base | {quality['base_ce']:.4f} | - | - | - |"]
        for name, v in q.items():
            lines.append(f"| {name} | {v['ce']:.4f} | {v['ce'] - quality['base_ce']:+.4f} | "
                         f"{v['max_abs_logit_diff']:.3g} | {'yes' if v['max_abs_logit_diff'] == 0 else 'no'} |")
    return "\n".join(lines) + "\n"


def curves(out: Path, names: list[str]) -> dict[str, dict]:
    """Per variant, from OUT/<variant>/metrics.jsonl (a resumed run's re-logged steps replace the
    earlier lines): sim_tau at every evaluation with its step and the training seconds until
    then (each log interval's NTP tokens over its NTP tokens/s: evaluations are not in them),
    and the run's NTP tokens/s overall."""
    result = {}
    for name in names:
        logged, evals = {}, {}
        path = out / name / "metrics.jsonl"
        for line in read_jsonl(path) if path.is_file() else []:
            rec = line.value
            if not isinstance(rec, dict):  # a line cut by an interruption
                continue
            if "sim_tau" in rec:
                evals[rec["step"]] = rec["sim_tau"]
            elif rec.get("ntp_tokens_per_s"):
                logged[rec["step"]] = rec
        seconds, tokens, at = 0.0, 0, {}
        for step in sorted(logged):
            rec = logged[step]
            seconds += (rec["tokens_seen"] - tokens) / rec["ntp_tokens_per_s"]
            tokens = rec["tokens_seen"]
            at[step] = seconds
        points = [{"step": step, "sim_tau": round(tau, 4),
                   "train_seconds": round(max((v for k, v in at.items() if k <= step), default=0.0), 1)}
                  for step, tau in sorted(evals.items())]
        result[name] = {"points": points, "train_seconds": round(seconds, 1),
                        "ntp_tokens_per_s": round(tokens / seconds, 2) if seconds else None}
    return result


def curves_markdown(runs: dict[str, dict]) -> list[str]:
    names = [n for n, r in runs.items() if r["points"]]
    if not names:
        return []
    first = runs[names[0]]
    lines = ["", "## sim_tau during training", "",
             "sim_tau (the trainer's evaluation) at each step, with the training seconds spent until then in "
             "brackets (evaluations excluded); NTP tokens/s over the whole run.", "",
             "| step | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    steps = sorted({p["step"] for n in names for p in runs[n]["points"]})
    for step in steps:
        cells = []
        for n in names:
            p = next((p for p in runs[n]["points"] if p["step"] == step), None)
            cells.append("-" if p is None else f"{p['sim_tau']:.3f} ({p['train_seconds']:.0f} s)")
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    lines += ["", "| variant | NTP tokens/s | vs " + names[0] + " | training seconds |", "|---|---|---|---|"]
    for n in names:
        r = runs[n]
        ratio = (r["ntp_tokens_per_s"] / first["ntp_tokens_per_s"]
                 if r["ntp_tokens_per_s"] and first["ntp_tokens_per_s"] else None)
        lines.append(f"| {n} | {fmt(r['ntp_tokens_per_s'], 1)} | {fmt(ratio)}x | {r['train_seconds']:.0f} |")
    return lines


def write_curves(runs: dict[str, dict], path: Path) -> None:
    """sim_tau against the step and against the training seconds, one line per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, r in runs.items() if r["points"]]
    if not names:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for n in names:
        points = runs[n]["points"]
        axes[0].plot([p["step"] for p in points], [p["sim_tau"] for p in points], marker="o", label=n)
        axes[1].plot([p["train_seconds"] / 60 for p in points], [p["sim_tau"] for p in points], marker="o", label=n)
    axes[0].set(xlabel="optimizer step", ylabel="sim_tau", title="per step")
    axes[1].set(xlabel="training minutes (evaluations excluded)", ylabel="sim_tau", title="per second")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plot(table: list[dict], results: dict, path: Path) -> None:
    """Bars of tau per comparison, one panel per group (plain LoRA in red: not lossless)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [g for g in GROUPS if any(r["group"] == g for r in table)]
    if not groups:
        return
    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 4.5), squeeze=False)
    for ax, group in zip(axes[0], groups):
        rows = [r for r in table if r["group"] == group]
        taus = [results["methods"][r["spec"]]["tau"] or 0.0 for r in rows]
        colors = ["tab:red" if r.get("plain") else ("tab:blue" if r["holds"] == "(reference)" else "tab:orange")
                  for r in rows]
        ax.bar(range(len(rows)), taus, color=colors)
        for i, t in enumerate(taus):
            ax.annotate(f"{t:.2f}", (i, t), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(rows)), [f"{r['variant']}\n{r['decoding']}" for r in rows], rotation=30, fontsize=7)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_title(group, fontsize=9)
    axes[0][0].set_ylabel("tau (tokens per target call)")
    fig.suptitle("blue: reference, orange: ablated, red: plain LoRA (not lossless)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
