"""The bench's and training's plots: tau and speed-up per category, the MTPC paper's
expressiveness/latency trade-off, and a training run's losses, accuracies and simulated tau.
matplotlib is imported inside each function, so importing this module stays cheap."""

from __future__ import annotations

from pathlib import Path

from mtpkit.data.jsonl import read_jsonl
from mtpkit.eval.report_warnings import MARK, timing_warnings


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


def write_curve_plot(table: dict, path: Path) -> None:
    """Simulated tau against training seconds, one line per run of an eval/tables.py curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, run in table["runs"].items():
        ax.plot([p["train_seconds"] for p in run["points"]], [p["sim_tau"] for p in run["points"]], marker="o", label=label)
    ax.set_xlabel("training seconds (evaluation excluded)")
    ax.set_ylabel("simulated tau (tokens per target call)")
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
