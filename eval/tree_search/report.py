"""The tree search's report (`eval/tree_frontier.py`): the bank's markdown table (per task: every
candidate tree with EntMTP's Appendix B pair, its one-step "biased" mean accept length and the
one on its own rollout; the schedules and their signals, the future-known bound; the held-out
check) and its plot (tau and tokens/s against draft nodes, per task)."""

from __future__ import annotations

from pathlib import Path

from mtpkit.eval.tree_search.schedules import NEVER

SIGNAL_WORDS = {"path": "path value", "path_sum": "path values summed over depths",
                "entropy": "smoothed block-start entropy", "accept": "EMA of the accept length",
                "ema": "EMA of the target's top-1"}


def signal_name(s: dict) -> str:
    """A schedule entry's signal in words: the path value's depth, a smoothed signal's alpha."""
    signal = s.get("signal", "path")
    words = SIGNAL_WORDS[signal]
    if signal in ("entropy", "accept", "ema"):
        return f"{words}, alpha {s['alpha']}"
    return f"{words} {s['value_depth']} deep" if s.get("value_depth") else words


def appendix_b(rows: list[dict], frontier_names: set[str]) -> str | None:
    """EntMTP's Appendix B line: the largest |biased - self| mean accept length over the
    throughput frontier's trees, and whether both rank them alike (None: no tree scored)."""
    scored = [r for r in rows if "biased_tau" in r and r["name"] in frontier_names]
    if not scored:
        return None
    gap = max(abs(r["biased_tau"] - r["self_tau"]) for r in scored)
    order = lambda key: [r["name"] for r in sorted(scored, key=lambda r: r[key])]  # noqa: E731
    same = order("biased_tau") == order("self_tau")
    return (f"Appendix B (one-step biased vs self-rollout mean accept length, the frontier's {len(scored)} trees): "
            f"max |biased - self| {gap:.3f}, {'the same' if same else 'ANOTHER'} ranking.")


def kernels_line(report: dict) -> str:
    """How the step costs' products ran, in words."""
    linear = report.get("linear", "stock")
    if linear == "auto" and report.get("kernels"):
        return "the kernel plan of this machine" + (" (the gated copy's own)" if report["kernels"]["adapted"] else "")
    return {"auto": "torch's layers (nothing packed)", "stock": "torch's layers",
            "onednn": "oneDNN for every product"}[linear]


def markdown(report: dict) -> str:
    decoding = (f"speculative sampling at T = {report['temperature']}, top-p {report['top_p']}"
                if report.get("temperature") else "greedy decoding")
    head = {"gated_lora": "sampler head" if report["sampler"] else "base head", "probe": "mask logits",
            "mtpc": "the circuit's exact conditionals", "medusa": "Medusa heads' top-k",
            "hydra": "Hydra heads' top-k on each parent's path"}[report["method"]]
    shape = ("trees at most k bytes deep, no mask blocks, Algorithm 2's cycle" if report["method"] == "mtpc" else
             "trees at most k heads deep, no mask blocks" if report["method"] in ("medusa", "hydra") else
             f"blocks = {report['blocks']}, as many masks per block as the tree has levels")
    lines = [f"Draft trees of {report['head']} on {report['backbone']} (k = {report['k']}, "
             f"{head}, {shape}); simulated {decoding}, step costs read off the cost curve of the forwards measured "
             f"on {report.get('device', 'cpu')} in {report.get('dtype', 'float32')} on {kernels_line(report)} (ms: AR "
             f"{report['costs_ms']['ar']}, prefill {report['costs_ms']['prefill']})", "",
             "Per-step cost of a tree switch (median us): choosing the tree {choose_tree_us}, its attention mask from "
             "the bank's precompiled layout {mask_from_bank_us}, the same mask with the layout rebuilt "
             "{mask_rebuilt_us}".format(**report["switch_cost"]), ""]
    for task, t in report["tasks"].items():
        lines += [f"**{task}** ({t['prompts']} prompts; simulated AR {t['sim_ar_tokens_per_s']} tok/s)", "",
                  "| tree | nodes | depth | rows/step | sim tau | biased | self | sim tok/s | vs AR | bank |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in t["trees"]:
            biased = f"{r['biased_tau']:.3f}" if "biased_tau" in r else "-"
            self_tau = f"{r['self_tau']:.3f}" if "self_tau" in r else "-"
            lines.append(f"| {r['name']} | {r['nodes']} | {r.get('depth', '')} | {r['rows']} | {r['sim_tau']:.3f} "
                         f"| {biased} | {self_tau} | {r['sim_tokens_per_s']:.1f} "
                         f"| {r['sim_tokens_per_s'] / t['sim_ar_tokens_per_s']:.2f}x | {'' if r['bank'] is None else r['bank']} |")
        frontier_names = {r["name"] for r in t["trees"] if r["bank"] in t.get("frontier", [])}
        line = appendix_b(t["trees"], frontier_names)
        if line:
            lines += ["", line]
        lines += ["", "| schedule | trees | thresholds | sim tau | sim tok/s |", "|---|---|---|---|---|"]
        for name, s in t["schedules"].items():
            if s["kind"] != "static":
                name = f"{name} ({signal_name(s)})"
            thresholds = [round(x, 4) for x in s["thresholds"]]
            if s["kind"] == "hyst" and s.get("signal", "path") == "path" and s["thresholds"][1] >= NEVER:
                thresholds = f"{thresholds}: never on, no threshold paid"
            lines.append(f"| {name} | {s['trees']} | {thresholds} | {s['sim_tau']:.3f} | {s['sim_tokens_per_s']:.1f} |")
        static = t["schedules"]["static"]["sim_tokens_per_s"]
        for kind in ("ladder", "hyst"):
            signals = t["schedules"].get(kind, {}).get("by_signal")
            if signals:
                lines += ["", f"{kind.capitalize()}'s best on each signal: " + ", ".join(
                    f"{signal_name(b)} {b['sim_tokens_per_s']:.1f} tok/s ({b['sim_tokens_per_s'] / static:.3f}x "
                    f"static, trees {b['trees']})" for b in signals.values()) + "."]
        if any(s.get("signal") == "entropy" for s in t["schedules"].values()):
            lines += ["", "Entropy thresholds are on exp(-H'), H' the smoothed block-start entropy in nats: "
                          "a threshold x is H' <= -ln x."]
        if "oracle" in t:
            o, oa = t["oracle"], t["oracle_ar"]
            lines += ["", f"The future known (an upper bound of every schedule over this task's trees, reached with "
                          f"trees {o['trees']}" + (f" on {o['block']}-mask blocks" if o["block"] else "") + "): "
                          f"{o['sim_tokens_per_s']:.1f} tok/s, {o['sim_tokens_per_s'] / static:.2f}x static "
                          f"(tau {o['sim_tau']:.3f}); with plain AR steps too: {oa['sim_tokens_per_s']:.1f} tok/s, "
                          f"{oa['sim_tokens_per_s'] / static:.2f}x static."]
        lines.append("")
    if "check" in report:
        c = report["check"]
        same = "outputs identical to AR" if c.get("matches_ar", True) else "SOME OUTPUTS DIFFER FROM AR"
        if report.get("temperature") and "replay_exact" in c:
            same = (f"sampled at T = {report['temperature']}; simulated on other draws; the replay of the decoder's "
                    f"own outputs takes {'exactly its steps' if c['replay_exact'] else 'OTHER STEPS than it'}")
        elif report.get("temperature"):
            same = (f"sampled at T = {report['temperature']}; simulated on other draws; on the decoder's own outputs "
                    f"the simulator's expected steps are within {100 * c['replay_max_abs_error']:.1f}% of its steps")
        lines += [f"Simulator check on {c['prompts']} held-out prompts ({'' if report.get('temperature') else 'greedy, '}{same}): "
                  f"max |error| {100 * c['max_abs_error']:.1f}%", "",
                  "| tree | nodes | decoded tau | simulated tau | error | differs from AR |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['name']} | {r['nodes']} | {r['decoded_tau']:.3f} | {r['sim_tau']:.3f} | {100 * r['error']:+.1f}% "
                  f"| {', '.join(map(str, r.get('differs_from_ar', []))) or '-'} |" for r in c["trees"]]
        lines.append("")
    lines.append(f"`{report['command']}`")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for task, t in report["tasks"].items():
        rows = sorted(t["trees"], key=lambda r: r["nodes"])
        axes[0].plot([r["nodes"] for r in rows], [r["sim_tau"] for r in rows], marker="o", label=task)
        axes[1].plot([r["nodes"] for r in rows], [r["sim_tokens_per_s"] / t["sim_ar_tokens_per_s"] for r in rows],
                     marker="o", label=task)
    axes[0].set(xlabel="draft nodes", ylabel="simulated tau", xscale="log", title="acceptance")
    axes[1].set(xlabel="draft nodes", ylabel="simulated tokens/s vs AR", xscale="log", title="throughput")
    axes[1].axhline(1.0, color="grey", lw=0.8)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
