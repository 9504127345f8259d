"""Benchmark speculative decoding methods through the one shared decoder.

    python eval/bench.py --backbone smollm2-135m-instruct --data humaneval.jsonl.gz gsm8k.jsonl \
        --limit 20 --max-new-tokens 128 --methods ar pld probe:bc=10 probe:bc=30 probe:bc=60,masks=2 \
        --out runs/bench/results.json

Methods (`name` or `name:key=value,key=value`; results are keyed by the full spec) are the entries of
`mtpkit.models.registry.METHODS`; the list with every option and its default is printed at the end
of `--help`. `ar` always runs (it is every speed-up's denominator), and so does `hf_ar`
unless `--baselines 0` (transformers' own `generate` on the untouched model: AR must not be
slower than what a user gets from transformers; on EvaByte, whose code has no `generate` that takes its EVA cache,
EvaByte's own AR loop: `mtpkit.models.evabyte.generate`).
Every mtpkit method, `ar` included, runs on the same target: with
`--linear auto` (the default) each of its products runs on the kernel measured fastest on this
machine for the step's row count (`mtpkit.models.kernel_plan`: timed once per machine, model
and dtype, then cached; `eval/bench_forward.py` prints the table), and `ar_stock` (the same
decoder on torch's untouched layers) runs beside it as a check; `--linear onednn` puts every
product on oneDNN's prepacked kernel (row-invariant); `--linear stock` keeps torch's layers.
`--device` (auto: CUDA when present) and `--dtype` (auto: bfloat16 on a GPU, float32 on a CPU)
place the target, its caches and every drafter; on a GPU `--linear auto` computes the same
fused products with `F.linear` (no oneDNN, no kernel plan: `mtpkit.models.packed_linear`),
`ar_stock` runs beside it, and the decoder takes its device path (one host read per greedy step).
Methods run interleaved prompt by prompt, in an order rotated per prompt, so machine drift hits
all of them alike.

Timing: `--rounds R` runs the whole interleaved set (every prompt x every method) R times, the
method order rotated per prompt and per round. Each timing is the median over the rounds and each
speed-up keeps its min-max spread over them (`speedup_vs_ar_spread`). A speed-up is flagged (a
`warnings` list in results.json, WARNING lines above the table, `!` after the ratio and in the
plot) when its spread exceeds 10% of its median; when a drafter's speed-up / tau exceeds 1 + that
spread, or its k-row target step (`step cost vs AR`, measured in the run) costs less than AR's
1-row step by more than the spread (a verification step cannot cost less than an AR step on the
same target: AR is then not on its fastest path); when `hf_ar` or `ar_stock` is faster than `ar`
by more than the spread; or when the machine's 1-minute load average, sampled after every
prompt, averages above its CPU count + 0.5 over the run (the bench's own threads hold it near the
CPU count). One round measures no spread, so every bound is then exact. After each round but the
last, results.json holds the rounds so far (marked `partial`): a run stopped early keeps them.

Prompts longer than the model's context (max_position_embeddings - --max-new-tokens) are skipped,
with a warning naming how many from which --data source (cut prompts would lose their chat
template's assistant header, so they are not cut).

Writes --out (must end in .json: per method and per category: tau, tokens_per_s, speedup_vs_ar,
matches_ar, target_calls, accept_counts, ...; plus every prompt's token ids and output ids),
and beside it, with the same stem: .md (tables), .png (tau and speed-up per category) and
_tradeoff.png (tokens per cycle against seconds per cycle, with iso-throughput lines: the MTPC
paper's Fig. 1). Whether all four can be written is checked before any model is loaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from mtpkit.data.chat import DataError
from mtpkit.data.eval_prompts import add_prompt_args, load_prompts
from mtpkit.data.jsonl import check_output_file
from mtpkit.models.decoding.decoder import Target, decode
from mtpkit.eval.bench_results import write_results
from mtpkit.eval.specs import MethodError, build_drafter, methods_help, parse_method
from mtpkit.eval.step_rows import RowsFloor, decode_floors
from mtpkit.models.backbone import (DEFAULT_BACKBONE, add_device_args, eos_token_ids, load_backbone,
                                    resolve_device, resolve_dtype)
from mtpkit.models.decoding.drafter import StockAR
from mtpkit.models.decoding.host_reads import counting_reads
from mtpkit.models.decoding.step import COMPILED, STEP_CHOICES, resolve_step
from mtpkit.models.evabyte.generate import evabyte_generate
from mtpkit.models.generate import hf_static_compiled
from mtpkit.models.process import run_script
from mtpkit.models.kernel_plan import pack_targets
from mtpkit.models.packed_linear import LINEARS, packable
from mtpkit.models.registry import METHODS


def check_methods(args) -> None:
    """Every --methods drafter built once (`build_drafter`), before any model loads. Exits with
    one line naming the method on the first that fails."""
    for spec in args.methods:
        try:
            drafter = build_drafter(spec)
        except (ValueError, FileNotFoundError) as e:
            sys.exit(f"bench: --methods {spec}: {e}")
        if getattr(drafter, "tree_log", None) is not None:
            drafter.tree_log.close()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, epilog=methods_help(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backbone", default=DEFAULT_BACKBONE,
                   help="target model: a known name, local HF folder or Hub id (default: %(default)s)")
    add_prompt_args(p, "every category gets its own row in the tables", default=["builtin"])
    p.add_argument("--methods", nargs="+", default=["ar", "pld", "probe"],
                   help="methods to compare, each `name` or `name:key=value,...` (see below; ar always runs, hf_ar "
                        "unless --baselines 0)")
    p.add_argument("--max-new-tokens", type=int, default=128,
                   help="tokens generated per prompt: about the reply length you serve (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (outputs checked against ar); > 0 = speculative sampling at this temperature, "
                        "to measure the sampled serving you run (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus mass when sampling, as you serve (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="sampling seed; prompt i uses seed + i: another seed, another draw (default: %(default)s)")
    add_device_args(p)  # --device, --dtype (the target's; greedy outputs are checked against AR in that dtype)
    p.add_argument("--compare-dtypes", nargs="+", default=None, metavar="DTYPE",
                   help="run every method on a target in each of these dtypes (e.g. float32 bfloat16), all "
                        "interleaved in one run, to choose the dtype you serve in; each dtype's speed-ups and AR "
                        "check are against its own AR, and results.json holds every dtype's results plus a "
                        "comparison table (overrides --dtype)")
    p.add_argument("--out", default="runs/bench/results.json",
                   help="results JSON (must end in .json); NAME.md, NAME.png and NAME_tradeoff.png are written "
                        "beside it (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every prompt x method this many times (order rotated per round); timings are "
                        "medians over the rounds with their min-max spread, and need >= 2 rounds for a spread: "
                        "use 3 for numbers you publish (default: %(default)s)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow custom model code: for a backbone whose Hub repo ships its own (e.g. EvaByte)")
    p.add_argument("--linear", choices=LINEARS, default="auto",
                   help="the target's linear layers, for every method alike: auto = on a CPU per row count the "
                        "kernel measured fastest on this machine (stock / fused F.linear / oneDNN; cached per "
                        "machine, model and dtype), on a GPU fused F.linear products (q/k/v and gate/up as one, "
                        "a gated adapter's A rows with them), onednn = oneDNN's prepacked kernel for every row "
                        "count on a CPU (row-invariant), stock = torch's layers untouched: keep auto unless you "
                        "compare kernels (default: %(default)s)")
    p.add_argument("--floor", default=None, metavar="DEVICE_JSON",
                   help="a device probe's results (eval/device_probe.py --out) on this machine: each method's "
                        "decoding step is also given in multiples of the step floor it measured (x floor); use it "
                        "to see how far the runtime is from what the hardware allows")
    p.add_argument("--step", choices=STEP_CHOICES, default="auto",
                   help="how every method's decoding steps run (AR's included, so all compare on one runtime): "
                        "eager = dynamic shapes on the growing cache; static = one fixed-shape step per tree shape on "
                        "a static cache; compile = those steps under torch.compile (compiled at first use, the "
                        "seconds reported as compile_s); graph = captured as CUDA graphs (CUDA only); compile_graph = "
                        "compiled, then captured (CUDA only: fewer kernels a replay); auto = on CUDA "
                        "compile_graph for plain AR, graph for drafters; on a CPU compile for AR and gated linear/quadratic chains once a run of this bench "
                        "with ar and ar:step=compile measured the compiled step faster on this machine, eager "
                        "otherwise (models/decoding/step_plan.py); a method's own step=MODE overrides it "
                        "(default: %(default)s)")
    p.add_argument("--baselines", type=int, choices=(0, 1), default=1,
                   help="1 = also run transformers' eager generate (hf_ar) and AR on stock kernels (ar_stock) when "
                        "--methods does not list them, to check that ar is the fastest AR here; 0 = ar and the "
                        "methods listed only (on a GPU, where eager generate costs several times every other "
                        "method and the probe already times it: list hf_ar:compile=1 instead) (default: %(default)s)")
    p.add_argument("--retune", action="store_true",
                   help="with --linear auto: measure the kernel plan again (and cache it) even if one is cached, "
                        "e.g. after the machine's load or software changed")
    args = p.parse_args(argv)
    try:
        args.parsed = [parse_method(s) for s in args.methods]
    except MethodError as e:
        p.error(str(e))
    if "ar" not in args.methods:
        args.methods.insert(0, "ar")
        args.parsed.insert(0, parse_method("ar"))
    args.auto_stock = args.baselines == 1 and args.linear != "stock" and "ar_stock" not in args.methods
    if args.auto_stock:
        args.methods.insert(1, "ar_stock")
        args.parsed.insert(1, parse_method("ar_stock"))
    if args.baselines == 1 and "hf_ar" not in args.methods:
        args.methods.insert(2 if args.auto_stock else 1, "hf_ar")
        args.parsed.insert(2 if args.auto_stock else 1, parse_method("hf_ar"))
    if len(set(args.methods)) != len(args.methods):
        p.error("--methods lists the same spec twice")
    if args.max_new_tokens < 1 or args.temperature < 0 or not 0 < args.top_p <= 1:
        p.error("--max-new-tokens must be >= 1, --temperature >= 0 and --top-p in (0, 1]")
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.floor is not None:
        try:
            args.floor_ms = float(json.loads(Path(args.floor).read_text())["floor_ms"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            p.error(f"--floor {args.floor}: not a device probe's results ({type(e).__name__}: {e})")
    if Path(args.out).suffix != ".json":
        p.error(f"--out must end in .json (the .md and .png files are written beside it), got {args.out!r}")
    return args


def output_paths(out: str) -> dict[str, Path]:
    """The four files the bench writes, all derived from --out (a .json path)."""
    json_path = Path(out)
    return {"json": json_path, "md": json_path.with_suffix(".md"), "png": json_path.with_suffix(".png"),
            "tradeoff": json_path.with_name(json_path.stem + "_tradeoff.png")}


def check_writable(paths: dict[str, Path]) -> None:
    """Exit with one line naming --out unless its folder can be made and written, and none of the
    output paths is a folder. Run before anything is loaded."""
    folder = paths["json"].parent
    try:
        for path in paths.values():  # a folder, a device or a FIFO is refused before anything is made
            check_output_file(path, "--out")
    except DataError as e:
        sys.exit(f"bench: --out {paths['json']}: cannot write there ({e})")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".bench-write-test-"):
            pass
    except OSError as e:
        sys.exit(f"bench: --out {paths['json']}: cannot write there ({e})")


def run_hf(model, tokenizer, name, cfg, ids, args, eos) -> dict:
    if getattr(model.config, "model_type", None) == "evabyte":  # its own AR loop: no generate() takes its cache
        started = time.perf_counter()
        tokens = evabyte_generate(model, ids, args.max_new_tokens, eos, args.temperature, args.top_p)
        return {"tokens": tokens, "seconds": time.perf_counter() - started}
    kwargs = dict(max_new_tokens=args.max_new_tokens, eos_token_id=sorted(eos), pad_token_id=tokenizer.pad_token_id,
                  do_sample=args.temperature > 0, **METHODS[name].generate_kwargs(cfg))
    if args.temperature > 0:
        kwargs.update(temperature=args.temperature, top_p=args.top_p, top_k=0)
    device = model.get_input_embeddings().weight.device
    if getattr(cfg, "compile", False):
        kwargs.update(hf_static_compiled(device))
    started = time.perf_counter()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids], device=device),
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device), **kwargs)
    return {"tokens": out[0, len(ids):].tolist(), "seconds": time.perf_counter() - started}


@dataclasses.dataclass
class Setup:
    """One target dtype's model, its drafters and their targets, ready to decode."""
    dtype: torch.dtype
    model: torch.nn.Module
    tokenizer: object
    eos: set
    drafters: dict
    targets: dict
    hf_model: torch.nn.Module
    kernels: dict | None
    compile_s: dict = dataclasses.field(default_factory=dict)  # spec -> seconds of its first (compiling) call
    host_reads: dict = dataclasses.field(default_factory=dict)  # spec -> mean host reads a decoding step
    floors: dict = dataclasses.field(default_factory=dict)  # spec -> RowsFloor on its target (the x_rows floor)
    floor_ms: dict = dataclasses.field(default_factory=dict)  # spec -> [`decode_floors` of each of its decodes]


def build(args, device: torch.device, dtype: torch.dtype) -> Setup:
    """The target in `dtype` on `device`, every --methods drafter adapted to it, the products packed
    on the measured kernel plan (a CPU), one warm-up decode per drafter on the first prompt."""
    model, tokenizer = load_backbone(args.backbone, dtype=dtype, trust_remote_code=args.trust_remote_code,
                                     device=device)
    if getattr(model.config, "model_type", None) == "evabyte":  # EVA attention: its own cache, the eager step
        for spec, (name, cfg) in zip(args.methods, args.parsed):  # hf_ar is EvaByte's own AR loop (`run_hf`)
            if METHODS[name].drafter is None and (name != "hf_ar" or getattr(cfg, "compile", False)):
                sys.exit(f"bench: --methods {spec}: EvaByte's code has no transformers generate() that takes its EVA "
                         "cache; its baseline is plain hf_ar (EvaByte's own AR loop)")
            if getattr(cfg, "step", "") not in ("", "auto", "eager"):
                sys.exit(f"bench: --methods {spec}: EvaByte decodes with the eager step only (its EVA window cache)")
        if args.step not in ("auto", "eager"):
            sys.exit(f"bench: --step {args.step}: EvaByte decodes with the eager step only (its EVA window cache)")
        args.step = "eager"  # auto would capture CUDA graphs on a GPU
    if args.auto_stock and not packable(model, linear=args.linear):
        # nothing will be packed (layers too small, or no oneDNN on a CPU): the two ARs would be one
        del args.parsed[args.methods.index("ar_stock")]
        args.methods.remove("ar_stock")
        args.auto_stock = False
    drafters, adapted, shared = {}, {}, {}
    for spec, (name, cfg) in zip(args.methods, args.parsed):
        if METHODS[name].drafter is not None:
            try:
                drafters[spec] = METHODS[name].drafter(cfg)
                adapted[spec] = drafters[spec].adapt(model, shared)
            except (ValueError, FileNotFoundError) as e:
                sys.exit(f"bench: --methods {spec}: {e}")
    # packed only now: adapters (peft) wrap plain nn.Linear layers, and every method's target
    # (the shared model and each adapted copy) is packed; plain copies take the model's kernel plan, gated
    # copies a plan timed on themselves (`tune`)
    stock = {id(a[0]) for spec, a in adapted.items() if isinstance(drafters[spec], StockAR)}
    # transformers' generate runs on the untouched model (what a user of transformers gets)
    hf_model = next((a[0] for spec, a in adapted.items() if isinstance(drafters[spec], StockAR)), model)
    distinct = {id(model): model, **{id(a[0]): a[0] for a in adapted.values()}}
    to_pack = [m for m in distinct.values() if id(m) not in stock]
    kernels = pack_targets(model, [m for m in to_pack if m is not model], args.linear, retune=args.retune)
    options = dict(zip(args.methods, args.parsed))  # a method's own `step` (ar:step=compile) over --step
    targets = {spec: Target(*a, step=resolve_step(getattr(options[spec][1], "step", "") or args.step, device, model,
                                                    drafters[spec]))
               for spec, a in adapted.items()}
    return Setup(dtype, model, tokenizer, eos_token_ids(model, tokenizer), drafters, targets, hf_model, kernels)


def run_rounds(args, setups: dict[str, Setup], prompts: list[dict], device: torch.device, after_round=None):
    """Every prompt x every (dtype, method) pair, --rounds times, the pair order rotated per
    prompt and per round; `after_round(rounds, loads)` after each round but the last (the results so
    far, kept if the run is stopped). Returns ({dtype name: [round: {spec: [run per prompt]}]}, load
    averages)."""
    pairs = [(d, m) for d in setups for m in range(len(args.methods))]
    room = max(len(p["ids"]) for p in prompts) + args.max_new_tokens + 64  # a static cache's positions
    for setup in setups.values():
        for spec in setup.drafters:  # warm-up: first calls pay one-off costs
            setup.targets[spec].max_len = room
            decode(setup.targets[spec], setup.drafters[spec], prompts[0]["ids"], 8)
        for spec, (name, cfg) in zip(args.methods, args.parsed):  # a compiling baseline: its compile, timed apart
            if METHODS[name].drafter is None and getattr(cfg, "compile", False):
                setup.compile_s[spec] = run_hf(setup.hf_model, setup.tokenizer, name, cfg, prompts[0]["ids"], args,
                                               setup.eos)["seconds"]
    for setup in setups.values():  # host reads a decoding step, counted on one untimed decode each
        for spec, drafter in setup.drafters.items():
            if setup.targets[spec].step in COMPILED:
                continue  # patching torch's read methods would make torch.compile recompile its steps
            with counting_reads(drafter) as steps:
                decode(setup.targets[spec], drafter, prompts[0]["ids"], min(args.max_new_tokens, 32), args.temperature,
                       args.top_p, setup.eos, torch.Generator(device).manual_seed(args.seed))
            setup.host_reads[spec] = statistics.mean(steps[1:]) if len(steps) > 1 else None
    cache_len = round(statistics.mean(len(p["ids"]) for p in prompts)) + args.max_new_tokens // 2
    longest = max(len(p["ids"]) for p in prompts) + args.max_new_tokens
    for setup in setups.values():  # each method's floor, timed after each of its decodes (`step_floors`)
        for spec, target in setup.targets.items():
            setup.floors[spec] = RowsFloor(target, cache_len, longest=longest)
            setup.floor_ms[spec] = []
    rounds, loads = {d: [] for d in setups}, []
    bar = tqdm(total=args.rounds * len(prompts) * len(pairs), desc="bench", unit="run")
    for r in range(args.rounds):
        runs = {d: {spec: [] for spec in args.methods} for d in setups}
        for i, prompt in enumerate(prompts):
            shift = (i + r) % len(pairs)
            for d, m in pairs[shift:] + pairs[:shift]:  # rotated to cancel order effects
                setup, spec, (name, cfg) = setups[d], args.methods[m], args.parsed[m]
                generator = torch.Generator(device).manual_seed(args.seed + i)
                if METHODS[name].drafter is None:
                    run = run_hf(setup.hf_model, setup.tokenizer, name, cfg, prompt["ids"], args, setup.eos)
                else:
                    res = decode(setup.targets[spec], setup.drafters[spec], prompt["ids"], args.max_new_tokens,
                                 args.temperature, args.top_p, setup.eos, generator)
                    run = dataclasses.asdict(res)
                    # its floors, as its steps ran
                    floors = decode_floors(setup.floors[spec], res, len(prompt["ids"]), setup.drafters[spec])
                    if floors is not None:
                        setup.floor_ms[spec].append(floors)
                runs[d][spec].append(run)
                bar.update(1)
                bar.set_postfix(method=spec, dtype=d, round=r + 1)
            loads.append(os.getloadavg()[0])
        for d in setups:
            rounds[d].append(runs[d])
        if after_round is not None and r + 1 < args.rounds:
            after_round(rounds, loads)
    bar.close()
    return rounds, loads


def main(argv=None) -> dict:
    args = parse_args(argv)
    paths = output_paths(args.out)
    check_writable(paths)
    try:
        device = resolve_device(args.device)
        dtypes = {str(d).removeprefix("torch."): d
                  for d in (resolve_dtype(flag, device) for flag in (args.compare_dtypes or [args.dtype]))}
    except ValueError as e:
        sys.exit(f"bench: {e}")
    if args.compare_dtypes and len(dtypes) < 2:
        sys.exit(f"bench: --compare-dtypes {' '.join(args.compare_dtypes)} names fewer than two dtypes")
    names = list(dtypes)
    check_methods(args)
    first = build(args, device, dtypes[names[0]])
    # the prompts and the context check need only the first target's tokenizer and config
    context = getattr(first.model.config, "max_position_embeddings", None)
    try:
        prompts = load_prompts(args, first.tokenizer, None if context is None else context - args.max_new_tokens)
    except DataError as e:
        sys.exit(f"bench: {e}")
    if not prompts:
        sys.exit(f"bench: no prompt of --data {' '.join(args.data)} fits the model's context "
                 f"({context} - --max-new-tokens {args.max_new_tokens})")
    setups = {names[0]: first, **{name: build(args, device, dtypes[name]) for name in names[1:]}}

    def partial(rounds, loads):  # the finished rounds' results, overwritten by the next
        done = len(next(iter(rounds.values())))
        write_results(args, setups, prompts, rounds, loads, paths, partial=f"{done} of {args.rounds} rounds")

    rounds, loads = run_rounds(args, setups, prompts, device, after_round=partial)
    return write_results(args, setups, prompts, rounds, loads, paths)


if __name__ == "__main__":
    run_script(main)
