"""Draft trees for a mask-token drafter (a gated-LoRA head, or the training-free probe), an MTPC
circuit head or Medusa / Hydra heads, chosen before serving: an acceptance simulator, the tau /
tokens-per-second frontier per task, a bank of non-dominated trees and calibrated schedules for the
run-time policies (after "EntMTP: Accelerating LLM Inference with Entropy Guided Multi Token
Prediction", Chen).

    python eval/tree_frontier.py --backbone smollm2-135m-instruct --head runs/gated_best/export \\
        --data humaneval.jsonl.gz gsm8k_test.jsonl builtin:eval --limit 12 --budgets 2,4,8,16 \\
        --out runs/trees/bank.json

The steps, one module of `mtpkit.eval.tree_search` each (their docstrings say how):
1. calibration: one teacher-forced pass per prompt over the target's continuation;
2. simulate: decoding replayed on it, exact for greedy decoding and for one-hot tree drafts
   under sampling (MTPC under sampling: chains only, their expected steps);
3. growth: per task and mask-block placement (`--blocks`), trees grown one node at a time; the
   `--budgets` sizes and the top-1 chains are the candidates;
4. pricing and schedules: every candidate's tokens/s on this machine, the frontier per task, the
   bank, the static / ladder / hyst schedules and the future-known bound;
5. check (`--holdout N`): the bank's trees decoded on held-out prompts against the simulator.

Writes --out (the bank: trees, schedules per task, frontiers, costs, the check) and beside it a
.md table and a .png (tau and tokens/s against draft nodes, per task). Use the bank with
`eval/bench.py --methods gated_lora:head=DIR,tree=bank.json,schedule=static|ladder|hyst,task=T`
(`--method probe`: `probe:tree=bank.json,masks=K,schedule=...,task=T`, K = --masks; `--method
medusa | hydra`: `medusa:head=DIR,tree=bank.json,task=T`, the task's static tree).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from mtpkit.data.eval_prompts import add_prompt_args, load_prompts
from mtpkit.eval.tree_search.calibration import calibrate_tasks
from mtpkit.eval.tree_search.check import check
from mtpkit.eval.tree_search.growth import candidate_trees
from mtpkit.eval.tree_search.pricing import kernel_summary, step_costs, switch_cost
from mtpkit.eval.tree_search.report import markdown, plot
from mtpkit.eval.tree_search.schedules import build_bank
from mtpkit.eval.tree_search.subjects import SUBJECTS
from mtpkit.models.atomic_write import write_atomic
from mtpkit.models.backbone import DEFAULT_BACKBONE, add_device_args, eos_token_ids, load_backbone
from mtpkit.models.decoding.decoder import Target
from mtpkit.models.packed_linear import LINEARS
from mtpkit.models.process import run_script
from mtpkit.models.schedules import SIGNALS
from mtpkit.models.trees import BLOCKS


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backbone", default=DEFAULT_BACKBONE, help="the target model (default: %(default)s)")
    p.add_argument("--method", default="gated_lora", choices=sorted(SUBJECTS),
                   help="the drafter whose trees are searched: gated_lora (a trained head, --head), probe (the "
                        "training-free mask-token probe, --masks / --init / --lam), mtpc (a circuit head on a byte "
                        "backbone, --head, --max-depth; under sampling chains only), medusa or hydra (their heads, "
                        "--head; trees as deep as the heads)")
    p.add_argument("--head", default="", help="gated_lora, mtpc, medusa, hydra: the head folder (train/export.py "
                                              "output)")
    p.add_argument("--sampler", type=int, default=-1, choices=[-1, 0, 1],
                   help="gated_lora: rank candidates by the sampler head (1) or the base head (0), as the bench "
                        "will decode with sampler=; -1 (auto, as the drafter's default): the sampler when the head "
                        "has one (default: %(default)s)")
    p.add_argument("--masks", type=int, default=0,
                   help="probe: masks per block, the deepest a tree may grow; the bench's masks= (default 3)")
    p.add_argument("--init", default="mean",
                   help="probe: mask embedding init, mean | hard | sample, as the bench will decode with init= "
                        "(default: %(default)s)")
    p.add_argument("--lam", type=float, default=0.1,
                   help="probe: mask update rate lambda, as the bench will decode with lam= (default: %(default)s)")
    p.add_argument("--max-depth", type=int, default=0,
                   help="mtpc: the deepest a tree may grow, to bound the sequential circuit queries a step makes "
                        "(default: min(8, the head's window n))")
    add_prompt_args(p, "every category is a task with its own frontier and schedules (the bench's task=)")
    p.add_argument("--holdout", type=int, default=0,
                   help="keep the last N prompts of each task out of the search and check the simulator on them "
                        "(decoded tau vs simulated tau of every bank tree): to trust a new head or machine")
    p.add_argument("--check-trees", type=int, default=6,
                   help="with --holdout: decode the bank's trees and further searched trees (smallest first) up to "
                        "this many in all; 0: no check (e.g. a --calibrations file priced on another device, where "
                        "decoding the held-out prompts costs that device's time)")
    p.add_argument("--max-new-tokens", type=int, default=96,
                   help="tokens of each calibration continuation: about the reply length you serve "
                        "(default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy decoding; > 0: search for speculative sampling at this temperature: the "
                        "calibration continuations are the target's samples, and the check decodes with sampling "
                        "(default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus mass when sampling, as you serve (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="sampling seed: prompt i's calibration draw uses seed + i; another seed, another draw "
                        "(default: %(default)s)")
    p.add_argument("--budgets", default="2,4,8,16",
                   help="draft-node counts of the grown trees that are priced and may enter the bank: larger "
                        "ones pay where a step of more rows costs little more, e.g. on a GPU (default: %(default)s)")
    p.add_argument("--max-rank", type=int, default=8,
                   help="candidates per head position the growth may use: more lets trees branch wider, at "
                        "more calibration memory (default: %(default)s)")
    p.add_argument("--blocks", default="chain",
                   help="comma-separated mask-block placements to search, each grown and priced on its own: chain "
                        "(the root and the top-1 path; quadratic decoding on a chain), all (every node), root, leaf "
                        "(the leaves only; linear decoding on a chain: a step that accepts no draft is followed by "
                        "one that drafts nothing). e.g. chain,leaf to let the bank hold both (default: %(default)s)")
    p.add_argument("--hyst-ratio", type=float, default=0.8,
                   help="hyst schedule: tau_off = this x tau_on; lower switches back less often on a noisy path "
                        "value (default: %(default)s)")
    p.add_argument("--value-depth", type=int, default=0,
                   help="ladder and hyst: depths of the head's top-1 chain in the path value (0: the ladder as deep "
                        "as the deepest scheduled tree, hyst swept from 1 to that depth). An MTPC head queries "
                        "them one after another, each a sequential circuit query per step; 1 costs none (the "
                        "tree's first query): use 1 where those queries are dear")
    p.add_argument("--signals", default="path,path_sum,entropy,accept,ema",
                   help="ladder and hyst: the run-time signals to sweep, the fastest kept (mtpkit.models.schedules): "
                        "path (EAGLE-2's path value at the value depth), path_sum (the path values summed over "
                        "depths), entropy (the smoothed block-start entropy), accept (the EMA of the accept "
                        "length), ema (the EMA of the target's top-1 probability). Those a method cannot replay "
                        "are skipped: MTPC path and path_sum only, ema mask-token drafters only; the gated_lora, "
                        "probe and mtpc drafters decode them (medusa and hydra: one static tree) "
                        "(default: %(default)s)")
    p.add_argument("--ema-alphas", default="0.5,0.8,0.9",
                   help="the weights on the old value of the smoothed signals (entropy, accept, ema), each swept; "
                        "'' = none of them (a shorter sweep) (default: %(default)s)")
    p.add_argument("--pool-speed", type=float, default=0.8,
                   help="the schedules may also use trees of the tau frontier whose simulated tokens/s is at least "
                        "this share of the best tree's (they join the bank); 0: every tau-frontier tree "
                        "(default: %(default)s)")
    p.add_argument("--pool-size", type=int, default=4,
                   help="at most this many trees per task for the schedules; more widens the sweep, which takes "
                        "longer (default: %(default)s)")
    p.add_argument("--cache-len", type=int, default=200,
                   help="KV-cache length the step costs are timed on: about the context you serve "
                        "(default: %(default)s)")
    p.add_argument("--rounds", type=int, default=7,
                   help="timing rounds of the step costs (median; the first is a warm-up): more on a noisy "
                        "machine (default: %(default)s)")
    p.add_argument("--linear", choices=LINEARS, default="auto",
                   help="the targets' linear layers, as eval/bench.py --linear (price the trees on the kernels the "
                        "bench will decode with): auto = the per-machine kernel plan (a GPU: fused F.linear products), "
                        "onednn, stock = torch's layers (default: %(default)s)")
    p.add_argument("--retune", action="store_true",
                   help="with --linear auto: measure the kernel plans again (and cache them), e.g. after the "
                        "machine changed")
    p.add_argument("--calibrations", default="",
                   help="a file for the calibration pass (step 1): read it when it exists (made with the same "
                        "options and prompts, else refused), write it when it does not; then growth, pricing and "
                        "the schedules run again without decoding the prompts (e.g. to price one pass on a GPU)")
    p.add_argument("--out", required=True, help="the bank (.json); .md and .png beside it")
    add_device_args(p)  # the step costs are this device's: a bank is chosen for the machine that serves it
    args = p.parse_args(argv)
    if not args.out.endswith(".json"):
        p.error(f"--out {args.out}: must end in .json")
    try:
        args.budgets = sorted({int(b) for b in args.budgets.split(",")})
    except ValueError:
        p.error(f"--budgets {args.budgets!r}: comma-separated node counts, e.g. 2,4,8,16")
    if args.budgets[0] < 1:
        p.error("--budgets: node counts must be >= 1")
    if args.value_depth < 0:
        p.error(f"--value-depth {args.value_depth}: must be >= 0")
    try:
        args.ema_alphas = tuple(sorted({float(a) for a in args.ema_alphas.split(",") if a.strip()}))
    except ValueError:
        p.error(f"--ema-alphas {args.ema_alphas!r}: comma-separated numbers in [0, 1), e.g. 0.5,0.8,0.9")
    if any(not 0.0 <= a < 1.0 for a in args.ema_alphas):
        p.error(f"--ema-alphas {args.ema_alphas}: each alpha must be in [0, 1)")
    args.signals = tuple(dict.fromkeys(x.strip() for x in args.signals.split(",") if x.strip()))
    for x in args.signals:
        if x not in SIGNALS:
            p.error(f"--signals {x!r}: each signal must be one of {', '.join(SIGNALS)}")
    args.blocks = list(dict.fromkeys(b.strip() for b in args.blocks.split(",")))
    for b in args.blocks:
        if b not in BLOCKS:
            p.error(f"--blocks {b!r}: each placement must be one of {', '.join(BLOCKS)}")
    if args.method in ("mtpc", "medusa", "hydra") and args.blocks != ["chain"]:
        p.error(f"--blocks: {args.method} trees carry no mask blocks")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(0)
    base, tokenizer = load_backbone(args.backbone, dtype=args.dtype, device=args.device)
    subject = SUBJECTS[args.method](args, base)
    k = subject.k
    tasks: dict[str, list[dict]] = {}
    for prompt in load_prompts(args, tokenizer, base.config.max_position_embeddings - args.max_new_tokens - k - 1):
        tasks.setdefault(prompt["category"], []).append(prompt)
    cals, held = calibrate_tasks(subject, Target(base), tasks, args, eos_token_ids(base, tokenizer))
    trees, candidates, biased = candidate_trees(cals, k, args.budgets, args.max_rank, args.blocks,
                                                subject.chains_only)

    target = subject.target
    mean_prompt = round(statistics.mean(c.prompt_len for cs in cals.values() for c in cs))
    costs, measured = step_costs(target, trees, k, mean_prompt, args.cache_len, args.rounds, subject.candidates,
                                 subject.masks)
    bank, task_reports = build_bank(cals, trees, candidates, k, costs, subject.masks, args.pool_speed, args.pool_size,
                                    args.hyst_ratio, args.value_depth, args.ema_alphas, args.signals, biased)
    report = {"backbone": args.backbone, "method": args.method, **subject.settings, "k": k,
              "device": str(target.device), "dtype": str(target.dtype).removeprefix("torch."),
              "blocks": ",".join(args.blocks), "max_new_tokens": args.max_new_tokens,
              "temperature": args.temperature, "top_p": args.top_p, "linear": args.linear,
              "kernels": kernel_summary(subject.kernels),
              "costs_ms": {n: round(1e3 * v, 3) for n, v in costs.items()},
              "measured_ms": {n: round(1e3 * v, 3) for n, v in measured.items()},
              "tasks": task_reports, "command": "python eval/tree_frontier.py " + " ".join(sys.argv[1:] if argv is None
                                                                                          else argv),
              "trees": [t.to_json() for t in bank], "switch_cost": switch_cost(bank, k, args.cache_len, target.dtype),
              "schedules": {task: t["schedules"] for task, t in task_reports.items()}}
    if args.holdout and args.check_trees > 0:
        in_bank = {id(t) for t in bank}
        extra = sorted((t for t in trees if id(t) not in in_bank), key=lambda t: t.num_nodes)
        report["check"] = check(subject, bank + extra[: max(0, args.check_trees - len(bank))], held, args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, json.dumps(report, indent=1) + "\n")
    write_atomic(out.with_suffix(".md"), markdown(report))
    plot(report, out.with_suffix(".png"))
    print(markdown(report))
    return report


if __name__ == "__main__":
    run_script(main)
