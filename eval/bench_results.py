"""What a bench run writes: each method's summary over the rounds (`mtpkit.eval.report.summarise`),
its steps against their floors (`x_rows`, `x_floor`), the step times `--step auto` learns from,
and results.json with its tables and plots beside it (or, after a round but the last, results.json
alone, marked `partial`)."""

from __future__ import annotations

import json
import os
import statistics

from mtpkit.eval.report import (FLOOR_VERSION, dtype_table, summarise, timing_warnings, write_markdown, write_plot,
                                write_tradeoff_plot)
from mtpkit.models.atomic_write import write_atomic
from mtpkit.models.decoding import step_plan
from mtpkit.models.decoding.drafter import Drafter


def machine_cores() -> int:
    """CPUs of the whole machine: the load average counts runnable tasks machine-wide."""
    return os.cpu_count() or 1


def step_floors(results: dict, setup, args) -> None:
    """Each method's decoding step against its floors (`mtpkit.eval.step_rows`, per decode: its
    median steps of its most frequent shapes over plain forwards of the same shapes on its target's
    kernels, timed after it in the run; the median over its decodes): `x_rows`, and `x_loop`, the
    same with the method's own model work taken out (the drafter's time from its steps, a gated
    adapter's mask rows gated in the floor, the draft redone before each floor forward): what the
    loop adds; `floor_version` names the statistic (`FLOOR_VERSION`). `x_floor` = its mean step over the
    device probe's step floor (--floor); `compile_s` of a compiling baseline."""
    for spec, r in results["methods"].items():
        if spec in setup.compile_s:
            r["compile_s"] = round(setup.compile_s[spec], 2)
        target = setup.targets.get(spec)
        if target is not None and target.steps is not None:  # fixed steps: capture/compilation, apart
            r["compile_s"] = round(target.steps.compile_seconds, 2)
            r["step"] = target.step
        if setup.host_reads.get(spec) is not None:
            r["host_reads_step"] = round(setup.host_reads[spec], 2)
        if r.get("decode_step_ms") is None or not setup.floor_ms.get(spec):
            continue
        floors = setup.floor_ms[spec]
        r["rows_ms"] = round(statistics.median(f["rows"] for f in floors), 3)
        r["x_rows"] = round(statistics.median(f["step"] / f["rows"] for f in floors), 4)
        r["floor_version"] = FLOOR_VERSION
        if r.get("decode_draft_ms") is not None:  # the drafter's time recorded: the loop's share, apart
            r["own_rows_ms"] = round(statistics.median(f["own"] for f in floors), 3)
            r["x_loop"] = round(statistics.median(f["loop"] / f["own"] for f in floors), 4)
        if getattr(args, "floor_ms", None):
            r["x_floor"] = round(r["decode_step_ms"] / args.floor_ms, 4)


def record_steps(results: dict, setup) -> None:
    """An eager and a compiled AR in one run (`ar ar:step=compile`) on a CPU: their decoding steps
    recorded for this machine and model, from which `--step auto` decides (`step_plan`)."""
    ars = {setup.targets[spec].step: (r.get("decode_step_ms"), setup.targets[spec])
           for spec, r in results["methods"].items() if spec in setup.targets and type(setup.drafters[spec]) is Drafter}
    if setup.model.get_input_embeddings().weight.device.type != "cpu" or "eager" not in ars or "compile" not in ars:
        return
    (eager_ms, _), (compiled_ms, compiled) = ars["eager"], ars["compile"]
    if None in (eager_ms, compiled_ms):
        return
    entry = step_plan.record(setup.model, eager_ms, compiled_ms, compiled.steps.compile_seconds)
    print(f"[bench] recorded for --step auto on this machine: AR's compiled step {compiled_ms:.1f} ms against "
          f"eager {eager_ms:.1f} ms -> auto {'compiles' if entry['compile'] else 'stays eager'} "
          f"({step_plan.plan_path(setup.model)})")


def write_results(args, setups: dict, prompts: list[dict], rounds: dict, loads: list[float], paths: dict,
                  partial: str | None = None) -> dict:
    """Summarise the rounds and write results.json; with `partial` (a run stopped before its last round
    keeps what it measured) the JSON alone, marked; else the tables and plots beside it, printed."""
    machine = {"cores": machine_cores(), "load_mean": round(statistics.mean(loads), 2), "load_max": round(max(loads), 2)}
    by_dtype = {}
    for name, setup in setups.items():
        results = summarise(rounds[name], prompts, setup.model, greedy=args.temperature <= 0, machine=machine)
        for spec, drafter in setup.drafters.items():  # a head let onto another backbone: marked, warned
            if getattr(getattr(drafter, "model", None), "other_backbone", False):
                results["methods"][spec]["other_backbone"] = True
        step_floors(results, setup, args)
        if partial is None:
            record_steps(results, setup)
        results["warnings"] = timing_warnings(results)[0]
        results["config"] = {k: v for k, v in vars(args).items() if k != "parsed"}
        results["config"].update(device=str(setup.model.get_input_embeddings().weight.device), dtype=name)
        if partial is not None:
            results["partial"] = partial
        if setup.kernels is not None:
            results["kernels"] = {k: setup.kernels[k] for k in ("machine", "rows", "plans", "measured_at", "load",
                                                                "cached")}
            if setup.kernels.get("adapted"):  # the gated-LoRA copies' own plans
                results["kernels"]["adapted"] = [{k: a[k] for k in ("model", "plans", "measured_at", "load", "cached")}
                                                 for a in setup.kernels["adapted"]]
        by_dtype[name] = results
    if len(by_dtype) == 1:
        results = by_dtype[next(iter(by_dtype))]
        write_atomic(paths["json"], json.dumps(results, indent=1))
        if partial is not None:
            print(f"[bench] {partial} done: {paths['json']}")
            return results
        table = write_markdown(results, paths["md"])
        write_plot(results, paths["png"])
        write_tradeoff_plot(results, paths["tradeoff"])
        print(table)  # WARNING lines (if any), the tables, the verdict
        print(f"[bench] wrote {paths['json']}, {paths['md']}, {paths['png']}")
        return results
    comparison = dtype_table(by_dtype)
    results = {"dtypes": by_dtype, "comparison": comparison, "machine": machine}
    if partial is not None:
        results["partial"] = partial
    write_atomic(paths["json"], json.dumps(results, indent=1))
    if partial is not None:
        print(f"[bench] {partial} done: {paths['json']}")
        return results
    tables = [f"## {name}\n\n" + write_markdown(r, paths["md"].with_name(f"{paths['md'].stem}_{name}.md"))
              for name, r in by_dtype.items()]
    write_atomic(paths["md"], f"## dtypes, one interleaved run\n\n{comparison}\n\n" + "\n\n".join(tables) + "\n")
    print("\n\n".join(tables))
    print(f"\n[bench] dtypes, one interleaved run ({' vs '.join(by_dtype)}):\n{comparison}")
    print(f"[bench] wrote {paths['json']}, {paths['md']}")
    return results
