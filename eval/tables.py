"""The results tables of README.md and docs/*.md, rebuilt from results files so they cannot drift.

    python eval/tables.py collect demo runs/demo/bench/results.json --command "python eval/bench.py ..."
    python eval/tables.py render            # rewrite every table block from docs/results/*.json
    python eval/tables.py render --check    # exit 1, naming the stale blocks, if anything would change

`collect NAME RESULTS_JSON --command CMD` keeps, from one eval/bench.py results.json, the bench's
`config` and each method's summary metrics (tau, tokens/s, speed-up vs AR and vs stock AR with
their spread over rounds, matches_ar, target ms per call, accepted tokens per depth, mu_lat /
mu_acc, and tau / speed-up per category), the rounds, machine load and timing warnings, with the
command that produced it and the date, in docs/results/NAME.json. Per-prompt token ids, outputs
and prompt ids are left out (some prompt sets may not be redistributed).

`curve NAME LABEL=OUTPUT_DIR ... --command CMD` keeps, from training runs' metrics.jsonl (train/medusa.py,
train/gated_lora.py), each run's `sim_tau` rows against its training seconds (`train_seconds`,
evaluation excluded; the frozen backbone's one pass that Medusa and Hydra heads train on,
`features_seconds`, is not in them) in docs/results/NAME.json, rendered as one table of every
run's points; `--plot FILE` also draws the curves (a .png).

`render` replaces the inside of every block

    <!-- table:NAME -->
    ...
    <!-- /table:NAME -->

in README.md and docs/*.md with docs/results/NAME.json's tables (formatted by
mtpkit.eval.report.markdown_table, the same formatter as the bench's results.md), the command
that measured them and the collect command. A block whose NAME has no results file is an error.
Files are written atomically (a temporary file, then a rename).
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import shlex
import sys
from pathlib import Path

from mtpkit.eval.report import FLOOR_VERSION, markdown_table, timing_warnings
from mtpkit.eval.report_plots import write_curve_plot
from mtpkit.models.atomic_write import write_atomic
from mtpkit.models.process import run_script

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = Path("docs") / "results"
# the summary metrics kept per method and per category (everything eval/report.py aggregates
# except per-prompt data)
METRICS = ("prompts", "new_tokens", "seconds", "tokens_per_s", "speedup_vs_ar", "speedup_vs_ar_spread",
           "speedup_vs_ar_rounds", "speedup_vs_stock_ar", "speedup_vs_stock_ar_spread", "tau",
           "target_calls", "accept_counts", "speedup_over_tau", "mean_step_ms", "target_ms_per_call",
           "decoder_overhead_share", "draft_share", "mean_forward_tokens", "mean_draft_nodes", "mu_lat", "mu_acc",
           "max_tokens_per_s", "matches_ar", "mismatches", "near_tie_mismatches", "step_cost_vs_ar",
           "step_cost_vs_ar_spread", "decode_step_ms", "decode_draft_ms", "decode_rows", "rows_ms", "own_rows_ms",
           "x_rows", "x_loop", "x_floor", "floor_version", "host_reads_step", "compile_s", "step")
# what a method's floor_version must be current for: the step-over-floor statistic of another
# version is another number, not shown beside today's
FLOOR_METRICS = ("rows_ms", "own_rows_ms", "x_rows", "x_loop")
BLOCK = re.compile(r"<!-- table:(?P<name>[\w.-]+) -->\n(?P<body>.*?)<!-- /table:(?P=name) -->", re.DOTALL)
OPENING = re.compile(r"<!-- table:([\w.-]+) -->")


class TableError(ValueError):
    pass


def summary(results: dict) -> dict:
    """results.json of eval/bench.py -> its config and summary metrics only."""
    methods = {}
    for spec, r in results["methods"].items():
        entry = {k: r[k] for k in METRICS if k in r}
        entry["per_category"] = {cat: {k: c[k] for k in METRICS if k in c} for cat, c in r["per_category"].items()}
        methods[spec] = entry
    # timing over rounds and the machine's load (absent from results of older benches)
    timing = {k: results[k] for k in ("rounds", "machine", "kernels") if k in results}
    out = {"config": results.get("config", {}), "categories": results["categories"], "methods": methods, **timing}
    out["warnings"] = timing_warnings(out)[0]  # by the rules the tables are rendered with
    return out


def collect(name: str, results_path: Path, command: str, root: Path = ROOT, date: str | None = None) -> Path:
    results = json.loads(Path(results_path).read_text())
    out = {"name": name, "command": command, "results": str(results_path),
           "date": date or datetime.date.today().isoformat(), **summary(results)}
    path = root / RESULTS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(out, indent=1) + "\n")
    return path


def curve(name: str, runs: list[tuple[str, Path]], command: str, root: Path = ROOT, date: str | None = None) -> Path:
    """Each run's sim_tau rows (step, train_seconds, sim_tau) from OUTPUT_DIR/metrics.jsonl ->
    docs/results/NAME.json."""
    out = {"name": name, "kind": "curve", "command": command, "date": date or datetime.date.today().isoformat(),
           "runs": {}}
    for label, folder in runs:
        rows = [json.loads(line) for line in (Path(folder) / "metrics.jsonl").read_text().splitlines() if line.strip()]
        points = [{"step": r["step"], "train_seconds": round(r["train_seconds"], 1), "sim_tau": round(r["sim_tau"], 4)}
                  for r in rows if "sim_tau" in r]
        if not points or any("train_seconds" not in r for r in rows if "sim_tau" in r):
            raise TableError(f"{folder}/metrics.jsonl: no sim_tau row with train_seconds (a run of a trainer "
                             "that logs them, with --eval-every)")
        out["runs"][label] = {"output_dir": str(folder), "points": points}
    path = root / RESULTS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(out, indent=1) + "\n")
    return path


def curve_text(table: dict) -> str:
    """A curve's block: a row per run, its points in order, then the command."""
    lines = ["| run | step | training seconds | sim_tau |", "|---|---|---|---|"]
    for label, run in table["runs"].items():
        steps = " / ".join(str(p["step"]) for p in run["points"])
        seconds = " / ".join(f"{p['train_seconds']:.0f}" for p in run["points"])
        taus = " / ".join(f"{p['sim_tau']:.3f}" for p in run["points"])
        lines.append(f"| {label} | {steps} | {seconds} | {taus} |")
    pairs = " ".join(f"{label}={run['output_dir']}" for label, run in table["runs"].items())
    return ("\n".join(lines) + f"\n\nMeasured on {table['date']} with `{table['command']}`; rebuild this table from "
            + f"those runs:\n\n```bash\npython eval/tables.py curve {table['name']} {pairs} "
            + f"--command {shlex.quote(table['command'])}\npython eval/tables.py render\n```\n")


def current_floors(table: dict) -> dict:
    """`table` with its methods' FLOOR_METRICS dropped where they were measured as another
    `FLOOR_VERSION` (or before versions were recorded)."""
    methods = {spec: {k: v for k, v in r.items() if r.get("floor_version") == FLOOR_VERSION or k not in FLOOR_METRICS}
               for spec, r in table["methods"].items()}
    return {**table, "methods": methods}


def table_text(table: dict) -> str:
    """The inside of a table block: the tables, then how to measure them again."""
    if table.get("kind") == "curve":
        return curve_text(table)
    table = current_floors(table)
    sampling = table["config"].get("temperature", 0) > 0
    collect_cmd = (f"python eval/tables.py collect {table['name']} {shlex.quote(table['results'])} "
                   f"--command {shlex.quote(table['command'])}")
    return (markdown_table(table, per_cycle=sampling)
            + f"\nMeasured on {table['date']} with:\n\n```bash\n{table['command']}\n```\n\n"
            + f"Rebuild this table from that run's results:\n\n```bash\n{collect_cmd}\npython eval/tables.py render\n```\n")


def documents(root: Path) -> list[Path]:
    return [p for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))] if p.is_file()]


def rendered(path: Path, root: Path) -> tuple[str, list[str]]:
    """The file's text with every block rebuilt, and the names of its blocks."""
    text = path.read_text()
    opened = OPENING.findall(text)
    names = [m.group("name") for m in BLOCK.finditer(text)]
    if sorted(opened) != sorted(names):
        unclosed = sorted(set(opened) - set(names)) or sorted(opened)
        raise TableError(f"{path}: block <!-- table:{unclosed[0]} --> has no matching <!-- /table:{unclosed[0]} -->")

    def rebuild(match: re.Match) -> str:
        name = match.group("name")
        source = root / RESULTS_DIR / f"{name}.json"
        if not source.is_file():
            raise TableError(f"{path}: table {name!r} has no results file {source}; make it with "
                             f"`python eval/tables.py collect {name} RESULTS_JSON --command \"BENCH COMMAND\"`")
        return f"<!-- table:{name} -->\n{table_text(json.loads(source.read_text()))}<!-- /table:{name} -->"

    return BLOCK.sub(rebuild, text), names


def render(root: Path = ROOT, check: bool = False) -> list[str]:
    """Rebuild every block; returns the stale blocks as `file:NAME`. Every file is rebuilt before
    any is written, so an error writes nothing; with check, nothing is written at all."""
    stale, changed = [], {}
    for path in documents(root):
        new, names = rendered(path, root)
        old = path.read_text()
        if new == old:
            continue
        old_blocks = {m.group("name"): m.group(0) for m in BLOCK.finditer(old)}
        new_blocks = {m.group("name"): m.group(0) for m in BLOCK.finditer(new)}
        stale += [f"{path.relative_to(root)}:{n}" for n in names if old_blocks[n] != new_blocks[n]]
        changed[path] = new
    if not check:
        for path, new in changed.items():
            write_atomic(path, new)
    return stale


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", type=Path, default=ROOT, help="repository root (default: this checkout)")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect", help="keep a bench run's summary as docs/results/NAME.json")
    c.add_argument("name", help="table name, as in <!-- table:NAME -->")
    c.add_argument("results", type=Path, help="results.json written by eval/bench.py")
    c.add_argument("--command", required=True, help="the exact eval/bench.py command that wrote it")
    v = sub.add_parser("curve", help="keep training runs' sim_tau against training seconds as docs/results/NAME.json")
    v.add_argument("name", help="table name, as in <!-- table:NAME -->")
    v.add_argument("runs", nargs="+", metavar="LABEL=OUTPUT_DIR", help="a training run's label and output folder")
    v.add_argument("--command", required=True, help="the commands that trained the runs")
    v.add_argument("--plot", type=Path, help="also draw the curves into this .png")
    r = sub.add_parser("render", help="rewrite every table block of README.md and docs/*.md")
    r.add_argument("--check", action="store_true", help="write nothing; exit 1 if any block is stale")
    args = p.parse_args(argv)
    try:
        if args.cmd == "collect":
            if not re.fullmatch(r"[\w.-]+", args.name):
                raise TableError(f"table name {args.name!r}: use letters, digits, '_', '-' or '.'")
            print(f"[tables] wrote {collect(args.name, args.results, args.command, args.root)}")
            return 0
        if args.cmd == "curve":
            if not re.fullmatch(r"[\w.-]+", args.name) or not all("=" in r for r in args.runs):
                raise TableError(f"table name {args.name!r} (letters, digits, '_', '-' or '.') and runs as LABEL=DIR")
            path = curve(args.name, [tuple(r.split("=", 1)) for r in args.runs], args.command, args.root)
            if args.plot:
                write_curve_plot(json.loads(path.read_text()), args.plot)
            print(f"[tables] wrote {path}" + (f" and {args.plot}" if args.plot else ""))
            return 0
        stale = render(args.root, check=args.check)
    except (TableError, FileNotFoundError, KeyError, json.JSONDecodeError) as e:
        print(f"tables: {e}", file=sys.stderr)
        return 2
    if args.check and stale:
        print("tables: stale table blocks (run `python eval/tables.py render`): " + ", ".join(stale), file=sys.stderr)
        return 1
    print(f"[tables] {'stale' if args.check else 'rewrote'}: {', '.join(stale) or 'nothing'}")
    return 0


if __name__ == "__main__":
    run_script(main, exit_status=True)
