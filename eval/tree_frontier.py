"""Draft trees for a mask-token drafter (a gated-LoRA head, or the training-free probe) or an MTPC
circuit head, chosen
before serving: an acceptance simulator, the tau / tokens-per-second frontier per task, a bank of
non-dominated trees and calibrated schedules for the run-time policies (after "EntMTP: Accelerating LLM Inference with Entropy Guided
Multi Token Prediction", Chen: greedy tree growth, one-step scoring, re-scoring on the tree's own
rollout, a throughput frontier, static / ladder / hysteresis schedules).

    python eval/tree_frontier.py --backbone smollm2-135m-instruct --head runs/gated_best/export \\
        --data humaneval.jsonl.gz gsm8k_test.jsonl builtin:eval --limit 12 --budgets 2,4,8,16 \\
        --out runs/trees/bank.json

1. Calibration (one teacher-forced pass per prompt): the target's greedy continuation of the
   prompt (`--max-new-tokens`; with `--temperature T` its sampled continuation), then one forward over prompt + continuation with a block of k masks
   after every generated position (the training layout, `mtpkit.data.mtp`), reading for every
   position t and depth d the rank of the true token x[t+1+d] among the head's candidates (the base
   head's W z_d, or the sampler's W MLP([E(x[t+d]); z_d]) given the true parent), the target's
   top-1 probability at t and the base head's top-1 probability at every mask (the path value's
   factors). `--method probe`: the same pass on the plain target with the probe's synthesised
   mask embeddings (`calibrate_probe`). `--method mtpc`: the circuit of every position's state
   over its window, the rank of each true byte in the exact conditional given the true bytes
   before it, and the top-1 conditionals along the circuit's own top-1 chain (`calibrate_mtpc`).
2. Simulation (greedy decoding): a step whose draft comes from the block after position t
   accepts the longest path of the tree whose ranks equal the true tokens' ranks; it yields that
   many tokens plus the bonus and moves to the deepest accepted node, whose own block (if the
   topology gives it one) drafts the next step; without one the next step drafts nothing. So the
   rollout of a tree (or a schedule switching trees by the path value) is decoding replayed, with
   the same steps as `mtpkit.models.gated_lora.drafter` takes, exact up to floating-point ties
   of the ranks (the check in 5 measures it). MTPC moves on by its Algorithm 2 (`cycle=alg2`):
   no mask blocks; after an accepted draft the bonus is dropped and the last accepted byte's
   state drafts next; after a rejection the bonus is kept and a one-byte forward computes its
   state (a step without tokens).
   Under speculative sampling (`--temperature`) the same rollout holds: a tree's drafts are
   one-hot (the head's top-ranked tokens), so the verifier's recursive rejection accepts a node
   iff the token it samples is that node's token, and the output follows the target's
   distribution. The steps are then a function of the output, and a rollout of the target's own
   samples draws from the decoder's distribution of steps (the `drafts=sample` chains, whose q
   is not one-hot, are not simulated).
   MTPC under sampling drafts from the circuit's q, not one-hot, so the steps are random given
   the output; but given the output y the drafted byte at a position is accepted with
   probability min(p(y), q(y)) / p(y) (accepted AND equal to y, over y's probability), with q the
   circuit's conditional given the true bytes before it and p the verifier's (tempered)
   target. The rollout (`rollout_sampled`) draws the acceptances of `replicas` decodes of each
   calibration from these, with Algorithm 2's exact sampling cycle (a full chain drops its
   bonus; after a rejection the bonus is kept and the next window is conditioned on it, no
   state-only step). Chains only: a sibling drawn without replacement has no such closed form,
   so under sampling the MTPC candidates are the chains of depth 1..--max-depth.
3. Growth (per task, and per mask-block placement of `--blocks`: chain = the root and the top-1
   path, quadratic decoding's blocks; leaf = the leaves only, linear decoding's): from the empty
   tree add one node at a time: every child of a node (depth <=
   k, the next rank under its parent) is scored by the mean accept length over the steps of the
   current tree's own rollout with that node added (one-step "what-if", biased upwards), the best
   is kept, ties going to the smaller rank sum along its path, then the shallower node. Every
   grown tree of a `--budgets` size is then re-scored on its own rollout (unbiased tau).
4. Throughput: tokens/s = tokens / (prefill + sum of step costs), the step cost of a tree being
   the measured median time of its own verifier forward (root + drafts + masks, gate on the
   masks, LM head on the rows the decoder computes) on a `--cache-len` cache on this machine,
   interleaved with the empty step and plain AR's 1-row step, on the kernels `eval/bench.py` decodes
   with (`--linear`, default auto: the per-machine kernel plan, the gated copy's its own);
   prefill measured on the mean prompt; with `--step-costs curve` (default) each forward is then
   read off the cost curve of its rows (`cost_curve`: shapes of the same body rows, LM-head rows
   and gate pooled, made non-decreasing in the work) instead of its own noisier median;
   plus the drafting of the tree from a block of that forward's outputs (the drafter's own
   `candidates`: top-k reads, sampler calls, mask rows' LM head where the forward skipped it).
   The rest of a step (the path value, the verifier's bookkeeping) is not in it: `eval/bench.py`
   measures the real thing.
   Per task the throughput frontier (more nodes only if more tokens/s) and the tau frontier (more
   nodes only if a higher tau) within --pool-speed of the fastest tree form the pool of the
   schedules, and the bank holds every task's pool: static (the fastest tree), ladder (the pool,
   small to large, thresholds swept), hyst (two trees of the pool, one below tau_on and one
   above it, every pair in both orders: the paper's conservative tree below and aggressive tree
   above, and the other way round, where a bigger step pays on the doubtful steps; tau_on swept
   from 0, always the second tree, to above every path value, never: a switch that pays on no
   threshold leaves hyst on its first tree; tau_off = --hyst-ratio x tau_on; the path value's
   depth swept too unless --value-depth fixes it; for a mask-token drafter every pair is also swept
   on the EMA of the target's top-1 probability over the generated tokens, `--ema-alphas`, and
   the faster signal kept).
   Greedy mask drafters also get the future-known bound (`oracle`): the fastest any schedule over
   the pool could be, each step's tree chosen knowing every tree's accept length there, and the
   same with plain AR steps allowed; how far the schedules are from it says how much a better
   run-time signal could still gain.
5. `--holdout N`: the last N prompts of each task are kept out of 1-4; every bank tree is then
   decoded on them through the real decoder (greedy, outputs checked against AR) and its decoded
   tau compared with the simulated one (the error is reported and written to the bank). Under
   sampling the two taus come from different draws, so they agree up to sampling noise; the
   check also replays the decoder's own outputs and requires exactly its steps (MTPC: reports
   the expected steps given those outputs against the decoder's steps).

Writes --out (the bank: trees, schedules per task, frontiers, costs, the check) and beside it a
.md table and a .png (tau and tokens/s against draft nodes, per task). Use the bank with
`eval/bench.py --methods gated_lora:head=DIR,tree=bank.json,schedule=static|ladder|hyst,task=T`
(`--method probe`: `probe:tree=bank.json,masks=K,schedule=...,task=T`, K = --masks).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from mtpkit.data.chat import IGNORE
from mtpkit.data.mtp import collate_cached, mask_inputs
from mtpkit.eval.bench import load_prompts
from mtpkit.models.decoding.decoder import Target, decode
from mtpkit.models.decoding.verify import attention_inputs
from mtpkit.models.backbone import DEFAULT_BACKBONE, add_device_args, eos_token_ids, load_backbone
from mtpkit.models.decoding.drafter import Drafter
from mtpkit.models.gated_lora.head import load_head
from mtpkit.models.heads import run_script, write_atomic
from mtpkit.models.kernel_plan import pack_targets
from mtpkit.models.packed_linear import LINEARS
from mtpkit.models.trees import BLOCKS, Schedule, Topology, compile_topology

MISS = 1 << 20  # rank of a true token outside the head's top `--max-rank` (or past the end)


@dataclass
class Calibration:
    """One prompt's teacher-forced pass: n generated tokens; for anchor j (position P - 1 + j,
    j < n) ranks[j, d-1] = rank of the true token at depth d in the head's candidates of the block
    after that position, target_top1[j] = the target's top-1 probability there and head_top1[j, d-1]
    = the base head's top-1 probability at mask d."""
    task: str
    prompt_len: int
    n: int
    ranks: torch.Tensor       # [n, k] long
    target_top1: torch.Tensor  # [n]
    head_top1: torch.Tensor    # [n, k]
    cycle: str = "block"
    """how decoding moves on: "block" (a mask-token drafter: the block after the deepest accepted
    node drafts the next tree) or "alg2" (MTPC, `calibrate_mtpc`)"""
    accept: torch.Tensor | None = None
    """MTPC under speculative sampling only, [n, W]: accept[j, i-1] = min(1, q(y | ...) / p(y | ...))
    for the true byte y at window position i of anchor j, the probability that the verifier
    accepted a draft there given that the output is y (None: greedy, `ranks` decide)"""
    head_top1_kept: torch.Tensor | None = None
    """MTPC under sampling, [n, k]: head_top1 with the true byte at window position 1 kept (the
    path value after a rejection, whose bonus the next window is conditioned on)"""
    window: int = 0
    """MTPC: the head's window n (a kept byte leaves n - 1 positions to draft)"""


@torch.no_grad()
def calibrate(model, ids: list[int], prompt_len: int, task: str, sampler: bool, max_rank: int,
              chunk: int = 256) -> Calibration:
    """The pass of step 1 for `ids` = prompt + the target's greedy continuation, on a GatedMTP."""
    k = model.config.k
    x = torch.tensor(ids)
    labels = x.clone()
    labels[:prompt_len] = IGNORE
    batch = _on(collate_cached([mask_inputs(x, labels, k)]), model.embed.weight.device)
    n = len(ids) - prompt_len
    gate = model.gate
    with gate(torch.zeros_like(batch["ntp_ids"], dtype=torch.bool)):
        out = model.body(input_ids=batch["ntp_ids"], use_cache=True)
    mask_index = batch["mask_index"]
    with gate(mask_index > 0):
        z = model.body(inputs_embeds=model.input_embeds(torch.zeros_like(mask_index), mask_index),
                       attention_mask=batch["attention_mask"].to(out.last_hidden_state.dtype),
                       position_ids=batch["position_ids"], past_key_values=out.past_key_values,
                       use_cache=False).last_hidden_state[0]  # [n * k, d]: anchor-major
    target_logits = model.lm_head(out.last_hidden_state[0, prompt_len - 1: len(ids) - 1]).float()  # [n, V]
    target_top1 = torch.softmax(target_logits, -1).amax(-1)
    prev = batch["prev_ids"][0]
    ranked = (lambda rows, base: model.sampler_logits(prev[rows], z[rows]).float()) if sampler else None
    ranks, head_top1 = rank_masks(model.lm_head, z, batch["labels"][0], k, max_rank, ranked, chunk)
    return Calibration(task, prompt_len, n, ranks, target_top1.cpu(), head_top1)


CALIBRATION_ARGS = ("backbone", "method", "sampler", "masks", "init", "lam", "max_depth", "limit", "per_category",
                    "skip", "holdout", "max_new_tokens", "temperature", "top_p", "seed", "max_rank")


def calibration_key(args, tasks: dict[str, list[dict]], dtype: torch.dtype) -> dict:
    """What a calibration pass depends on: the options that decide it, the weight dtype it ran in,
    the head (a folder by the digest of its files, so a head trained again in the same folder is
    another head, and a copied folder the same one) and every task's prompt ids (not the data
    files' paths). A file made on one machine is thereby read on another, e.g. to price the same
    calibration on a GPU."""
    key = {name: getattr(args, name, None) for name in CALIBRATION_ARGS}
    key["dtype"] = str(dtype).removeprefix("torch.")
    head = Path(args.head) if getattr(args, "head", "") else None
    if head is not None and head.is_dir():
        digest = hashlib.sha256()
        for f in sorted(head.rglob("*")):
            if f.is_file():
                digest.update(f.relative_to(head).as_posix().encode() + f.read_bytes())
        key["head_digest"] = digest.hexdigest()
    else:
        key["head"] = getattr(args, "head", None)
    return {**key, "prompts": {task: [p["ids"] for p in items] for task, items in tasks.items()}}


def save_calibrations(path, key: dict, cals: dict, held: dict) -> None:
    """The calibration pass (calibration split and held-out prompts) and the key it was made under,
    for `--calibrations` to read instead of decoding and calibrating again."""
    data = {"key": key, "cals": {t: [vars(c) for c in cs] for t, cs in cals.items()},
            "held": {t: [(p, vars(c), cont) for p, c, cont in items] for t, items in held.items()}}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    torch.save(data, path)
    print(f"tree_frontier: the calibration pass written to {path}")


def load_calibrations(path, key: dict) -> tuple[dict, dict]:
    """(calibrations, held-out) written by `save_calibrations` under the same `key`; a file made
    with other options or prompts is refused by name."""
    try:
        data = torch.load(path, weights_only=True)
        saved = data["key"]
        cals = {t: [Calibration(**c) for c in cs] for t, cs in data["cals"].items()}
        held = {t: [(p, Calibration(**c), cont) for p, c, cont in items] for t, items in data["held"].items()}
    except Exception as e:  # a truncated or foreign file
        raise SystemExit(f"tree_frontier --calibrations {path}: not a calibration file written by this tool ({e})")
    differ = [name for name in key if saved.get(name) != key[name]]
    if differ:
        raise SystemExit(f"tree_frontier --calibrations {path}: made with other {', '.join(differ)} than this run; "
                         "pass another file (or delete it) to calibrate again")
    return cals, held


def _on(batch: dict, device) -> dict:
    return {name: t.to(device) if isinstance(t, torch.Tensor) else t for name, t in batch.items()}


def rank_masks(lm_head, z: torch.Tensor, y: torch.Tensor, k: int, max_rank: int, ranked=None,
               chunk: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """(ranks [n, k], head_top1 [n, k]) of the mask outputs z [n * k, d] (anchor-major) whose true
    tokens are y [n * k] (IGNORE past the end): the rank of each true token among the candidates
    `ranked(rows, base logits)` (default: the base logits lm_head(z)), MISS outside `max_rank`, and
    the base head's top-1 probability."""
    ranks = torch.full((len(y),), MISS, dtype=torch.long)
    head_top1 = torch.zeros(len(y))
    for s in range(0, len(y), chunk):
        rows = slice(s, min(s + chunk, len(y)))
        base = lm_head(z[rows]).float()
        head_top1[rows] = torch.softmax(base, -1).amax(-1).cpu()
        logits = base if ranked is None else ranked(rows, base)
        valid = y[rows] != IGNORE
        truth = logits.gather(1, y[rows].clamp(min=0)[:, None])
        r = (logits > truth).sum(-1)
        ranks[rows] = torch.where(valid & (r < max_rank), r, torch.full_like(r, MISS)).cpu()
    return ranks.view(-1, k), head_top1.view(-1, k)


@torch.no_grad()
def calibrate_probe(target: Target, drafter, ids: list[int], prompt_len: int, task: str, max_rank: int,
                    chunk: int = 256) -> Calibration:
    """The pass of step 1 for the probe (`mtpkit.models.probe`) on the plain `target`: the
    masks after the anchor at position P - 1 + j carry the probe's embeddings after the first j
    generated tokens (its prompt init, then Eq. 4 once per token); `drafter` a `ProbeDrafter` with
    k masks per block. Decoding feeds a step's masks the embeddings as they were at the step's
    root, so after an accepted draft of L tokens they are L updates behind these (lambda = 0.1:
    the check in 5 measures what that costs)."""
    k = drafter.k
    x = torch.tensor(ids)
    labels = x.clone()
    labels[:prompt_len] = IGNORE
    batch = _on(collate_cached([mask_inputs(x, labels, k)]), target.device)
    n = len(ids) - prompt_len
    drafter.begin(target, ids[:prompt_len])
    states = [drafter.masks.clone()]  # [k, d] per anchor j
    for token in ids[prompt_len: len(ids) - 1]:
        states.append(states[-1] + drafter.config.lam * (drafter.table[token] - states[-1]))
    states = torch.stack(states)  # [n, k, d]
    out = target.body(input_ids=batch["ntp_ids"], use_cache=True)
    mask_index, positions = batch["mask_index"][0], batch["position_ids"][0]
    anchor = positions - mask_index - (prompt_len - 1)  # j of every mask row
    embeds = states[anchor.clamp(0, n - 1), (mask_index - 1).clamp(min=0)][None].to(out.last_hidden_state.dtype)
    z = target.body(inputs_embeds=embeds, attention_mask=batch["attention_mask"].to(out.last_hidden_state.dtype),
                   position_ids=batch["position_ids"], past_key_values=out.past_key_values,
                   use_cache=False).last_hidden_state[0]  # [n * k, d]: anchor-major
    target_top1 = torch.softmax(target.lm_head(out.last_hidden_state[0, prompt_len - 1: len(ids) - 1]).float(), -1).amax(-1)
    ranks, head_top1 = rank_masks(target.lm_head, z, batch["labels"][0], k, max_rank, chunk=chunk)
    return Calibration(task, prompt_len, n, ranks, target_top1.cpu(), head_top1)


@torch.no_grad()
def calibrate_mtpc(model, target: Target, ids: list[int], prompt_len: int, task: str, depth: int, max_rank: int,
                   chunk: int = 64, temperature: float = 0.0, top_p: float = 1.0) -> Calibration:
    """The pass of step 1 for an MTPC head (`mtpkit.models.mtpc`, `cycle=alg2`): for anchor j
    (position t = P - 1 + j) the circuit of e_t (`MTPCModel.features`: the final state, or the
    draft layers') over its window; ranks[j, d-1] = the rank of the true byte x[t+d] in the
    circuit's exact conditional given the true bytes x[t+1..t+d-1] (ties as the drafter's stable
    sort breaks them: the lower byte first), head_top1[j, d-1] = the circuit's top-1 conditional
    probability at position d along its own top-1 chain (the drafter's `chain_value`),
    target_top1[j] = the target's top-1 probability at t. With `temperature` > 0 (speculative
    sampling, `ids` the target's own sample) also `accept` (the per-byte acceptance probability
    given the output, up to window position depth + 1) and `head_top1_kept`."""
    from mtpkit.models.generate import target_probs
    from mtpkit.models.mtpc.circuits import next_log_probs_posterior
    from mtpkit.models.mtpc.drafter import chain_log_top1

    device = target.device
    x = torch.tensor(ids, device=device)[None]
    n, P = len(ids) - prompt_len, prompt_len
    e = model.features(x)[0, P - 1: P - 1 + n]  # [n, d]
    logits = target.lm_head(target.body(input_ids=x).last_hidden_state[0, P - 1: P - 1 + n]).float()  # [n, V]
    target_top1 = torch.softmax(logits, -1).amax(-1).cpu()
    span = model.cfg.n
    sampled = temperature > 0
    width = min(depth + 1, span) if sampled else depth
    if sampled:  # the verifier's p of every generated byte
        p_true = target_probs(logits, temperature, top_p).gather(1, x[0, P:, None])[:, 0]  # [n]
        p_true = torch.cat([p_true, p_true.new_ones(span)])
        accept = torch.zeros(n, width)
        kept = torch.zeros(n, depth)
    ranks = torch.full((n, depth), MISS, dtype=torch.long)
    head_top1 = torch.zeros(n, depth)
    padded = torch.cat([x[0], x.new_zeros(span)])
    for s in range(0, n, chunk):
        rows = torch.arange(s, min(s + chunk, n), device=device)
        params = model.head(e[rows])
        truth = torch.stack([padded[P + j: P + j + span] for j in rows.tolist()])  # [B, span]: x[t+1..t+span]
        for d in range(1, width + 1):
            log_q = next_log_probs_posterior(params, truth, d - 1)  # [B, V]
            y = truth[:, d - 1]
            at = log_q.gather(1, y[:, None])
            valid = rows + d <= n  # x[t+d] is a generated byte
            if sampled:
                a = (at[:, 0].exp() / p_true[rows + d - 1].clamp_min(1e-30)).clamp(max=1.0)
                accept[rows.cpu(), d - 1] = torch.where(valid, a, torch.zeros_like(a)).float().cpu()
            if d > depth:
                continue
            vocab = torch.arange(log_q.shape[-1], device=device)[None]
            r = ((log_q > at) | ((log_q == at) & (vocab < y[:, None]))).sum(-1)
            ranks[rows.cpu(), d - 1] = torch.where(valid & (r < max_rank), r, torch.full_like(r, MISS)).cpu()
        chain = torch.zeros(len(rows), span, dtype=torch.long, device=device)
        head_top1[rows.cpu()] = chain_log_top1(params, chain, 0, depth).exp().float().cpu()
        if sampled and span > 1:  # the chain after the kept true byte at window position 1
            chain = torch.zeros(len(rows), span, dtype=torch.long, device=device)
            chain[:, 0] = truth[:, 0]
            deep = min(depth, span - 1)
            kept[rows.cpu(), :deep] = chain_log_top1(params, chain, 1, deep).exp().float().cpu()
    return Calibration(task, prompt_len, n, ranks, target_top1, head_top1, cycle="alg2",
                       accept=accept if sampled else None, head_top1_kept=kept if sampled else None, window=span)


def accept_length(topology: Topology, ranks: list[int]) -> int:
    """Drafts a greedy verifier accepts from `topology` when the true tokens have `ranks`."""
    path, depth = (), 0
    for r in ranks:
        path += (r,)
        if path not in topology.index:
            break
        depth += 1
    return depth


@dataclass
class Rollout:
    """A simulated decode: steps (target calls, prefill included), tokens, the anchor and the
    accepted drafts of every drafted step, and the tree of every step (None: no draft)."""
    steps: int
    tokens: int
    anchors: list[tuple[int, int]]  # (calibration index, anchor j) of each drafted step
    accepted: list[int]             # drafts accepted at each drafted step
    trees_used: list[int | None]
    block: int  # masks per block: the depth of the deepest tree in use (0: MTPC, no masks)
    replicas: int = 1  # decodes simulated per calibration (MTPC under sampling draws its acceptances)

    @property
    def tau(self) -> float:
        return self.tokens / max(self.steps, 1)


def path_value(cal: Calibration, j: int, depth: int, kept: int = 0) -> float:
    """The drafters' path value at anchor j (MTPC: with `kept` bytes kept after it, its chain
    `depth` bytes deep or as deep as the window leaves)."""
    head = cal.head_top1 if not kept else cal.head_top1_kept
    if cal.window:
        depth = min(depth, cal.window - kept)
    return float(cal.target_top1[j] * head[j, :depth].prod())


def rollout(cals: list[Calibration], trees: list[Topology], k: int, schedule: Schedule | None = None,
            replicas: int = 32, seed: int = 0) -> Rollout:
    """Greedy decoding replayed (step 2 of the module docstring) with `schedule` over `trees`
    (None: trees[0] on every step), with blocks of as many masks as the deepest tree in use has
    levels, as the drafter does. MTPC calibrations under sampling: `rollout_sampled` (`replicas`
    decodes per calibration, acceptances drawn from `seed`)."""
    schedule = schedule or Schedule("static", [0])
    depth = max(trees[i].depth for i in schedule.trees)
    if depth > k:
        raise ValueError(f"a tree of depth {depth} needs more than the head's k={k} masks")
    ema = schedule.switches and schedule.signal == "ema"
    if ema and any(cal.cycle != "block" for cal in cals):
        raise ValueError("signal=ema schedules are for mask-token drafters; MTPC schedules read the path value")
    if any(cal.accept is not None for cal in cals):
        return rollout_sampled(cals, trees, schedule, replicas, seed)
    steps = tokens = 0
    anchors, accepted, used = [], [], []
    block = 0 if any(cal.cycle == "alg2" for cal in cals) else depth  # MTPC: no mask blocks (`NAME@0`)
    for c, cal in enumerate(cals):
        ranks = cal.ranks.tolist()
        position = schedule.start()
        alg2 = cal.cycle == "alg2"
        # the prompt's forward: a mask drafter keeps its bonus; MTPC (Algorithm 2) drops it, and the
        # last prompt token's state drafts next
        bonus = 0 if alg2 else 1
        steps, tokens, gen, j, has = steps + 1, tokens + min(bonus, cal.n), bonus, 0, True
        # signal=ema: the target's top-1 probability of every generated token (token j: at anchor j)
        top1 = cal.target_top1.tolist() if ema else []
        value = schedule.smooth(None, top1[:1])  # the prompt forward's token
        while gen < cal.n:
            if has:
                if schedule.switches:
                    if not ema:
                        value = path_value(cal, j, schedule.depth_of_value(depth))
                    position = schedule.next(position, value)
                tree = trees[schedule.trees[position]]
                L = accept_length(tree, ranks[j])
                anchors.append((c, j))
                accepted.append(L)
                used.append(schedule.trees[position])
                if alg2:  # the accepted bytes (the bonus dropped), or after a rejection the bonus alone
                    new, has = max(L, 1), L > 0
                else:
                    new, has = L + 1, (tree.index[tuple(ranks[j][:L])] if L else 0) in tree.block_nodes
            else:  # mask drafter: the root's block alone, and its bonus; MTPC: the kept bonus's state, no tokens
                L, new, has = 0, 0 if alg2 else 1, True
                used.append(None)
            if ema:  # the step's tokens j + 1 .. j + new, predicted by its root's and accepted nodes' rows
                value = schedule.smooth(value, top1[j + 1: j + 1 + new])
            steps += 1
            tokens += min(new, cal.n - gen)
            gen += new
            j += new
    return Rollout(steps, tokens, anchors, accepted, used, block)


def rollout_sampled(cals: list[Calibration], trees: list[Topology], schedule: Schedule, replicas: int,
                    seed: int) -> Rollout:
    """MTPC chains under speculative sampling (the drafter's exact `cycle=alg2`), `replicas`
    decodes of each calibration's output. A draft chain of depth D after anchor j with m kept
    bytes (m = 0 after a fully accepted chain, whose bonus is dropped; m = 1 after a rejection,
    whose bonus the next window is conditioned on, at no extra forward) covers window positions
    m+1..m+D (at most the window), and given the output y its i-th byte is accepted with
    probability accept[j, m+i-1] = min(1, q(y) / p(y)): the chance that a draft drawn from q and
    verified against p is accepted AND equals y, over p(y). Acceptances of successive bytes are
    drawn in turn (the output after a prefix depends on it alone), so each replica is a draw of
    the decoder's steps given its output, and their mean is the expected number of steps. The
    uniforms are shared by absolute position across trees and schedules (common random numbers:
    their comparisons are not noise). Trees must be chains: a sibling drawn without replacement
    is accepted with a probability these p(y), q(y) do not give."""
    for i in schedule.trees:
        if trees[i].num_nodes != trees[i].depth:
            raise ValueError(f"tree {trees[i].name}: MTPC under sampling simulates chains only "
                             "(siblings drawn without replacement are not simulated)")
    deepest = max(trees[i].depth for i in schedule.trees)
    gen = torch.Generator().manual_seed(seed)
    steps = tokens = 0
    anchors, accepted, used = [], [], []
    for c, cal in enumerate(cals):
        accept = cal.accept.tolist()
        coins = torch.rand(replicas, cal.n + 1, generator=gen).tolist()
        for r in range(replicas):
            u = coins[r]
            position = schedule.start()
            steps += 1  # the prompt's forward: no tokens; its last state drafts next
            j = m = 0   # anchor (bytes generated through its state) and kept bytes after it
            while j + m < cal.n:
                if schedule.switches:
                    position = schedule.next(position, path_value(cal, j, schedule.depth_of_value(deepest), m))
                tree = schedule.trees[position]
                depth = min(trees[tree].depth, cal.window - m)
                L = 0
                while L < depth and j + m + L < cal.n and u[j + m + L] < accept[j][m + L]:
                    L += 1
                new = L if L == depth else L + 1  # a full chain drops its bonus
                anchors.append((c, j))
                accepted.append(L)
                used.append(tree)
                steps += 1
                tokens += min(new, cal.n - j - m)
                j, m = j + m + L, 0 if L == depth else 1
    return Rollout(steps, tokens, anchors, accepted, used, 0, replicas)


def grow(cals: list[Calibration], k: int, max_nodes: int, max_rank: int, blocks: str) -> list[Topology]:
    """Trees of 1..max_nodes nodes grown one node at a time (step 3 of the module docstring)."""
    paths: list[tuple[int, ...]] = []
    grown = []
    for size in range(1, max_nodes + 1):
        # the current tree's own rollout (the empty tree: every step drafts from its block)
        if paths:
            sim = rollout(cals, [Topology(paths, blocks)], k)
            visits = list(zip(sim.anchors, sim.accepted))
        else:
            visits = [((c, j), 0) for c, cal in enumerate(cals) for j in range(cal.n - 1)]
        have = set(paths)
        candidates = []
        for parent in [()] + paths:
            if len(parent) >= k:
                continue
            r = sum(1 for p in paths if len(p) == len(parent) + 1 and p[:-1] == parent)
            if r < max_rank:
                candidates.append(parent + (r,))
        counts = dict.fromkeys(candidates, 0)
        for (c, j), L in visits:
            if L < k:
                nxt = tuple(cals[c].ranks[j, : L + 1].tolist())
                if nxt in counts and nxt not in have:
                    counts[nxt] += 1
        best = max(candidates, key=lambda p: (counts[p], -sum(p), -len(p)))
        paths.append(best)
        grown.append(Topology(list(paths), blocks, name=f"g{size}"))
    return grown


# ---- step costs on this machine ----

def device_clock(device: torch.device) -> Callable[[], float]:
    """time.perf_counter, after waiting for `device`'s queued work (a GPU runs asynchronously)."""
    if device.type != "cuda":
        return time.perf_counter

    def clock() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()
    return clock


@torch.no_grad()
def step_costs(target: Target, topologies: list[Topology], k: int, prompt_len: int, cache_len: int,
               rounds: int, candidates: Callable | None = None, with_masks: bool = True,
               curve: bool = True) -> tuple[dict, dict]:
    """Seconds of one verifier forward of every topology with blocks of every size from its depth
    to k (`NAME@B`), of the empty step (`none@B`), AR's 1-row step (`ar`) and the prefill,
    interleaved over `rounds` rounds on a `cache_len` cache. `with_masks=False` (MTPC): no mask
    blocks, the steps `NAME@0` and `none@0` (one row: a kept bonus's state). With `candidates` (the
    drafter's `candidates(step, rows, compiled)`), also the drafting of each tree from a block of
    that forward's outputs (`draft:NAME@B`: top-k reads, sampler calls, LM-head rows the forward
    did not compute). Returns (costs, measured): measured = every item's median; costs = the same
    with each forward read off the cost curve (`cost_curve`) when `curve`, else the medians."""
    from transformers import DynamicCache

    from mtpkit.models.decoding.drafter import StepOutput

    vocab, d = target.embed.weight.shape
    clock = device_clock(target.device)
    masks = torch.zeros(1, d, dtype=target.dtype, device=target.device)
    ctx = torch.randint(0, vocab, (cache_len,), device=target.device)[None]
    base = DynamicCache(config=target.config)
    target.body(input_ids=ctx, past_key_values=base, use_cache=True)

    def shapes():
        yield "ar", [-1], 0, None
        for block in range(1, k + 1) if with_masks else [0]:
            yield f"none@{block}", [-1] + list(range(block)), block, None
        for t in topologies:
            for block in range(max(t.depth, 1), k + 1) if with_masks else [0]:
                c = compile_topology(t, block)
                yield f"{t.name}@{block}", list(c.full_parents), len(c.full_parents) - 1 - t.num_nodes, c

    def head_rows(Q: int, extras: int) -> int:  # LM-head rows `run` computes with the forward
        return Q if Q <= target.prefetch_rows else 1 + max(1, Q - extras)

    def run(parents, extras, compiled=None):
        cache = copy.deepcopy(base)
        Q = len(parents)
        ids = torch.randint(0, vocab, (Q - extras,), device=target.device)
        embeds = target.embed(ids)[None]
        if extras:
            embeds = torch.cat([embeds, masks.repeat(extras, 1)[None]], 1)
        mask, pos = attention_inputs(tuple(parents), cache_len, target.dtype, target.device)
        gate = contextlib.nullcontext()
        if target.gate is not None and extras:  # the adapter on the masks, as the decoder does
            gate = target.gate(torch.arange(Q)[None] >= Q - extras)
        t0 = clock()
        with gate:
            h = target.body(inputs_embeds=embeds, attention_mask=mask, position_ids=pos, past_key_values=cache,
                            use_cache=True).last_hidden_state[0]
        every = target.lm_head(h[: head_rows(Q, extras)]).float()
        seconds = clock() - t0
        if compiled is None:
            return seconds, None

        def logits(rows):  # as the decoder's: rows it computed with the forward, the others now
            return torch.stack([every[r] if r < len(every) else target.lm_head(h[r]).float() for r in rows])

        step = StepOutput(accepted=[], last_node=0, new_tokens=[int(ids[0])], hidden=h, logits=logits)
        t0 = clock()
        candidates(step, compiled.block_rows[compiled.topology.block_nodes[0]], compiled)  # any block: k rows
        return seconds, clock() - t0

    def prefill():
        cache = DynamicCache(config=target.config)
        ids = torch.randint(0, vocab, (prompt_len + (k if with_masks else 0),), device=target.device)[None]
        t0 = clock()
        target.body(input_ids=ids, past_key_values=cache, use_cache=True)
        return clock() - t0

    items = list(shapes())
    times = {name: [] for name, _, _, _ in items}
    times["prefill"] = []
    for _ in tqdm(range(rounds + 1), desc="step costs", unit="round"):
        for name, parents, extras, compiled in items:
            forward, drafting = run(parents, extras, compiled if candidates is not None else None)
            times[name].append(forward)
            if drafting is not None:
                times.setdefault("draft:" + name, []).append(drafting)
        times["prefill"].append(prefill())
    times = {name: v[1:] for name, v in times.items()}  # the first round warms up
    measured = {name: statistics.median(v) for name, v in times.items()}
    if not curve:
        return measured, measured
    gate = target.gate is not None  # `run` switches the adapter on for the masks
    rows = {name: (len(parents), head_rows(len(parents), extras), gate and extras > 0)
            for name, parents, extras, _ in items}
    return {**measured, **cost_curve(times, rows, body_head_ratio(target))}, measured


def body_head_ratio(target: Target) -> float:
    """Parameters of the body (embeddings excluded: a lookup) over the next-token LM head's
    (vocab x d): the work of a body row in LM-head rows."""
    vocab, d = target.embed.weight.shape
    embed = {id(target.embed.weight)}
    body = sum(p.numel() for p in target.body.parameters() if id(p) not in embed)
    return body / (vocab * d)


def cost_curve(samples: dict[str, list[float]], rows: dict[str, tuple[int, int, bool]], ratio: float) -> dict:
    """The forward costs read off one cost curve instead of each shape's own median: a forward's
    time depends on its rows (Q through the body, L through the LM head, and whether the gate
    switches the adapter on), not on which tree gave them, so the samples of all shapes with the
    same `rows[name]` = (Q, L, gated) are pooled into one median, and the medians are made
    non-decreasing in the work ratio * Q + L (pool-adjacent-violators, weighted by samples), gated
    and ungated forwards apart. A shape's own median carries the machine's timing noise, which
    reorders trees whose taus differ by less; on the curve a forward of more work never costs less."""
    out = {}
    for gated in (False, True):
        keys = sorted({r for r in rows.values() if r[2] == gated}, key=lambda r: (ratio * r[0] + r[1], r))
        blocks = []  # [value, weight, keys]
        for key in keys:
            pooled = [x for name, r in rows.items() if r == key for x in samples[name]]
            blocks.append([statistics.median(pooled), len(pooled), [key]])
            while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
                (v1, w1, k1), (v2, w2, k2) = blocks.pop(-2), blocks.pop()
                blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, k1 + k2])
        value = {key: v for v, _, ks in blocks for key in ks}
        out.update({name: value[r] for name, r in rows.items() if r[2] == gated})
    return out


def kernel_summary(record: dict | None) -> dict | None:
    """The kernel plans the step costs were timed on (`pack_targets`' record): the target's and
    the gated copies'."""
    if record is None:
        return None
    return {"plans": record["plans"], "adapted": [a["plans"] for a in record.get("adapted", [])],
            "measured_at": record["measured_at"]}


def kernels_line(report: dict) -> str:
    """How the step costs' products ran, in words."""
    linear = report.get("linear", "stock")
    if linear == "auto" and report.get("kernels"):
        return "the kernel plan of this machine" + (" (the gated copy's own)" if report["kernels"]["adapted"] else "")
    return {"auto": "torch's layers (nothing packed)", "stock": "torch's layers",
            "onednn": "oneDNN for every product"}[linear]


def switch_cost(bank: list[Topology], k: int, cache_len: int, dtype, reps: int = 200) -> dict:
    """Microseconds per step, median over `reps` steps cycling through the bank: choosing a tree
    (`TopologyBank.get`), the step's attention inputs from its precompiled layout, and the same
    built from the parents list (what a bank saves)."""
    from mtpkit.models.trees import TopologyBank, tree_layout

    compiled = TopologyBank(bank, k)
    build = getattr(tree_layout, "__wrapped__", tree_layout)  # uncached

    def timed(fn) -> float:
        samples = []
        for i in range(reps):
            t0 = time.perf_counter()
            fn(i % len(compiled))
            samples.append(time.perf_counter() - t0)
        return round(1e6 * statistics.median(samples), 2)

    return {"choose_tree_us": timed(lambda i: compiled.get(i)),
            "mask_from_bank_us": timed(lambda i: attention_inputs((), cache_len, dtype, layout=compiled.get(i).layout)),
            "mask_rebuilt_us": timed(lambda i: attention_inputs((), cache_len, dtype,
                                                                layout=build(compiled.get(i).full_parents)))}


def tokens_per_s(sim: Rollout, cals: list[Calibration], costs: dict, trees: list[Topology]) -> float:
    seconds = len(cals) * sim.replicas * costs["prefill"]
    for used in sim.trees_used:
        name = f"none@{sim.block}" if used is None else f"{trees[used].name}@{sim.block}"
        seconds += costs[name] + costs.get("draft:" + name, 0.0)  # the tree drafted for this step
    return sim.tokens / seconds


# ---- the bank ----

def frontier(trees: list[Topology], values: list[float]) -> list[int]:
    """Indices of the non-dominated trees: sorted by nodes (the better first among trees of as many
    nodes), each kept only if its value (tokens/s, or tau) is above every smaller tree's kept before it."""
    order = sorted(range(len(trees)), key=lambda i: (trees[i].num_nodes, -values[i]))  # a tie: the best first
    kept, best = [], 0.0
    for i in order:
        if values[i] > best:
            kept.append(i)
            best = values[i]
    return kept


def schedule_pool(trees: list[Topology], speeds: list[float], taus: list[float], pool_speed: float,
                  pool_size: int) -> tuple[list[int], list[int]]:
    """(the throughput frontier, the schedules' pool) of one task's candidate `trees`, as indices.
    The pool: the throughput frontier, and the trees of the tau frontier (more nodes only for a
    higher tau) within `pool_speed` of the fastest tree's tokens/s (a tree slower on average may
    still pay on the confident steps a schedule gives it); at most `pool_size` of them, the
    fastest, so the best static tree is always among them; ordered by nodes."""
    kept = frontier(trees, speeds)
    pool = list(kept)
    for i in frontier(trees, taus):
        if speeds[i] >= pool_speed * max(speeds) and i not in pool:
            pool.append(i)
    pool = sorted(pool, key=lambda i: -speeds[i])[:pool_size]
    return kept, sorted(pool, key=lambda i: trees[i].num_nodes)


NEVER = 2.0
"""a hyst tau_on above every path value (a product of probabilities): the schedule never switches on"""


def oracle(cals: list[Calibration], trees: list[Topology], pool: list[int], costs: dict,
           ar_steps: bool = False) -> dict | None:
    """The best any schedule over `pool` could do on `cals`: every step's choice made knowing the
    future (the accept length of every tree at every anchor), by dynamic programming over (anchor,
    whether a mask block drafted it) on the simulator's steps and `costs`. A step may use a pool
    tree, ignore its draft (the root's block alone), or with `ar_steps` be a plain AR step (no
    draft and no block: the next step drafts nothing). A schedule's deepest tree sets its block,
    so the bound is the best over blocks D of the pool's trees at most D deep on D-mask blocks.
    An upper bound of every schedule's simulated tokens/s, not a policy (it reads the future).
    None for MTPC and under sampling (greedy mask drafters only)."""
    if any(cal.cycle != "block" or cal.accept is not None for cal in cals):
        return None
    results = []
    for block in sorted({trees[i].depth for i in pool}):
        used = [i for i in pool if trees[i].depth <= block]
        options = [(trees[i], costs[f"{trees[i].name}@{block}"] + costs.get(f"draft:{trees[i].name}@{block}", 0.0))
                   for i in used]
        none, ar = costs[f"none@{block}"], costs["ar"]
        seconds, steps, tokens = len(cals) * costs["prefill"], len(cals), 0
        for cal in cals:
            n, ranks = cal.n, cal.ranks.tolist()
            # best[j][h]: (seconds, steps) to finish from anchor j (j + 1 tokens generated), h = a block drafted it
            best = [[(0.0, 0)] * 2 for _ in range(n + 1)]
            for j in range(n - 2, -1, -1):
                moves = [(none, 1, 1)] + ([(ar, 1, 0)] if ar_steps else [])
                best[j][0] = min((c + best[j + new][h][0], 1 + best[j + new][h][1]) for c, new, h in moves)
                for tree, c in options:
                    L = accept_length(tree, ranks[j])
                    has = (tree.index[tuple(ranks[j][:L])] if L else 0) in tree.block_nodes
                    moves.append((c, L + 1, int(has)))
                best[j][1] = min((c + best[min(j + new, n - 1)][h][0], 1 + best[min(j + new, n - 1)][h][1])
                                 for c, new, h in moves)
            seconds += best[0][1][0]
            steps += best[0][1][1]
            tokens += n
        results.append({"trees": used, "block": block, "ar_steps": ar_steps, "sim_tau": round(tokens / steps, 4),
                        "sim_tokens_per_s": round(tokens / seconds, 2)})
    return max(results, key=lambda r: r["sim_tokens_per_s"])


def calibrate_schedules(cals, trees, task_trees: list[int], k, costs, ratio: float, value_depth: int = 0,
                        ema_alphas: tuple[float, ...] = ()) -> dict:
    """Static, ladder and hyst schedules of one task (indices into `trees`), swept in simulation.
    The ladder's path value is `value_depth` deep (0: the deepest tree's depth); hyst's depth is
    swept from 1 to the deepest tree's with its pair and threshold unless `value_depth` fixes it.
    With `ema_alphas` (mask-token drafters) hyst's pairs are also swept on the EMA signal (the
    target's top-1 probability averaged over the generated tokens, each alpha, thresholds at the
    quantiles of that probability); hyst is the faster signal's best, and its entry's `by_signal`
    holds each signal's best.
    Hyst pairs every two pool trees in both orders: the first is used below tau_on, the second
    above it, so the sweep also finds a pair whose bigger step pays on the doubtful steps (the
    chain-block tree's extra root block proposes again after a rejection). Where no pair is faster
    than the static tree, hyst is the static tree (trees (s, s)): never slower in simulation."""
    simulated = {}  # a schedule is simulated once: the sweep's winners are read again below

    def speed(schedule):
        key = json.dumps(schedule.to_json())
        if key not in simulated:
            sim = rollout(cals, trees, k, schedule)
            simulated[key] = tokens_per_s(sim, cals, costs, trees), sim.tau
        return simulated[key]

    def entry(schedule) -> dict:
        s, tau = speed(schedule)
        return {**schedule.to_json(), "sim_tau": round(tau, 4), "sim_tokens_per_s": round(s, 2)}

    static = max(task_trees, key=lambda i: speed(Schedule("static", [i]))[0])
    out = {"static": Schedule("static", [static])}
    deepest = max(trees[i].depth for i in task_trees)

    grids = {}

    def grid(depth: int) -> tuple[list[float], list[float]]:  # (sorted path values, 19 quantiles of them)
        if depth not in grids:
            values = sorted(path_value(cal, j, depth) for cal in cals for j in range(cal.n))
            grids[depth] = values, sorted({values[int(q * (len(values) - 1))] for q in [i / 20 for i in range(1, 20)]})
        return grids[depth]

    values, quantiles = grid(Schedule("static", value_depth=value_depth).depth_of_value(deepest))
    # small to large: nodes, then rows a step on the schedule's blocks (placements differ)
    ladder_trees = sorted(task_trees, key=lambda i: (trees[i].num_nodes, trees[i].rows(deepest)))
    if len(ladder_trees) >= 2:
        # thresholds one at a time, coordinate ascent from the quantiles
        thresholds = [values[int(len(values) * (i + 1) / len(ladder_trees))] for i in range(len(ladder_trees) - 1)]
        for i in range(len(thresholds)):
            lo = thresholds[i - 1] if i else 0.0
            hi = thresholds[i + 1] if i + 1 < len(thresholds) else 1.0
            options = [v for v in quantiles if lo <= v <= hi] or [thresholds[i]]
            thresholds[i] = max(options, key=lambda v: speed(Schedule("ladder", ladder_trees,
                                                                       thresholds[:i] + [v] + thresholds[i + 1:],
                                                                       value_depth))[0])
        out["ladder"] = Schedule("ladder", ladder_trees, thresholds, value_depth)
        # (below tau_on, above it): the small tree first, then the other order
        pairs = [(a, b) for x, a in enumerate(ladder_trees) for b in ladder_trees[x + 1:]]
        pairs += [(b, a) for a, b in pairs]
        depths = [value_depth] if value_depth else [d if d < deepest else 0 for d in range(deepest, 0, -1)]
        # the sweep's two ends too: always the second tree (0) and never (NEVER: above every path
        # value, a product of probabilities), so a switch that pays nowhere leaves the first tree
        # alone; the ends read no path value, so they are tried on the first depth only
        candidates = []
        for x, d in enumerate(depths):
            sweep = [0.0, *grid(d or deepest)[1], NEVER] if x == 0 else grid(d)[1]
            candidates += [Schedule("hyst", [a, b], [ratio * v, v], d) for a, b in pairs for v in sweep]
        # last, the static tree itself: a pair's trees share the deeper one's blocks, so where the
        # static tree is shallower than every pair it is in, no pair reaches it
        candidates.append(Schedule("hyst", [static, static], [ratio * NEVER, NEVER]))
        by_signal = {"path": max(candidates, key=lambda s: speed(s)[0])}  # equals: the default depth, the small tree below
        if ema_alphas and all(cal.cycle == "block" for cal in cals):
            top1 = sorted(p for cal in cals for p in cal.target_top1.tolist())
            sweep = sorted({top1[int(q * (len(top1) - 1))] for q in [i / 20 for i in range(1, 20)]})
            by_signal["ema"] = max((Schedule("hyst", [a, b], [ratio * v, v], signal="ema", alpha=alpha)
                                    for a, b in pairs for alpha in ema_alphas for v in sweep), key=lambda s: speed(s)[0])
        out["hyst"] = max(by_signal.values(), key=lambda s: speed(s)[0])  # equals: the path value
    result = {name: entry(schedule) for name, schedule in out.items()}
    if "hyst" in out and len(by_signal) > 1:
        result["hyst"]["by_signal"] = {signal: entry(schedule) for signal, schedule in by_signal.items()}
    return result


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backbone", default=DEFAULT_BACKBONE, help="the target model (default: %(default)s)")
    p.add_argument("--method", default="gated_lora", choices=sorted(SUBJECTS),
                   help="the drafter whose trees are searched: gated_lora (a trained head, --head), probe (the "
                        "training-free mask-token probe, --masks / --init / --lam) or mtpc (a circuit head on a byte "
                        "backbone, --head, --max-depth; under sampling chains only)")
    p.add_argument("--head", default="", help="gated_lora, mtpc: the head folder (train/export.py output)")
    p.add_argument("--sampler", type=int, default=-1, choices=[-1, 0, 1],
                   help="gated_lora: rank candidates by the sampler head (1) or the base head (0); -1 (auto, as "
                        "the drafter's default): the sampler when the head has one (default: %(default)s)")
    p.add_argument("--masks", type=int, default=0,
                   help="probe: masks per block, the deepest a tree may grow (default 3)")
    p.add_argument("--init", default="mean", help="probe: mask embedding init, mean | hard | sample (default: %(default)s)")
    p.add_argument("--lam", type=float, default=0.1, help="probe: mask update rate lambda (default: %(default)s)")
    p.add_argument("--max-depth", type=int, default=0,
                   help="mtpc: the deepest a tree may grow (default: min(8, the head's window n))")
    p.add_argument("--data", nargs="+", required=True,
                   help="prompt sources as in eval/bench.py; every category (a file's name or the record's "
                        "`category`) is a task with its own frontier and schedules")
    p.add_argument("--limit", type=int, default=None, help="at most N prompts per source")
    p.add_argument("--per-category", type=int, default=None, help="at most N prompts per task")
    p.add_argument("--skip", type=int, default=0,
                   help="leave out the first N prompts of each task (e.g. the ones a bench run measures with "
                        "--limit N), so calibration and bench prompts are disjoint")
    p.add_argument("--holdout", type=int, default=0,
                   help="keep the last N prompts of each task out of the search and check the simulator on them "
                        "(decoded tau vs simulated tau of every bank tree)")
    p.add_argument("--check-trees", type=int, default=6,
                   help="with --holdout: decode the bank's trees and further searched trees (smallest first) up to "
                        "this many in all; 0: no check (e.g. a --calibrations file priced on another device, where "
                        "decoding the held-out prompts costs that device's time)")
    p.add_argument("--max-new-tokens", type=int, default=96, help="tokens of each calibration continuation")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy decoding; > 0: speculative sampling at this temperature: the calibration "
                        "continuations are the target's samples, and the check decodes with sampling "
                        "(default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass when sampling (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed: prompt i's calibration draw uses seed + i "
                                                        "(default: %(default)s)")
    p.add_argument("--budgets", default="2,4,8,16",
                   help="draft-node counts of the grown trees that are re-scored and may enter the bank")
    p.add_argument("--max-rank", type=int, default=8, help="candidates per head position the growth may use")
    p.add_argument("--blocks", default="chain",
                   help="comma-separated mask-block placements to search, each grown and priced on its own: chain "
                        "(the root and the top-1 path; quadratic decoding on a chain), all (every node), root, leaf "
                        "(the leaves only; linear decoding on a chain: a step that accepts no draft is followed by "
                        "one that drafts nothing). e.g. chain,leaf (default: %(default)s)")
    p.add_argument("--hyst-ratio", type=float, default=0.8, help="hyst schedule: tau_off = this x tau_on")
    p.add_argument("--value-depth", type=int, default=0,
                   help="ladder and hyst: depths of the head's top-1 chain in the path value (0: the ladder as deep "
                        "as the deepest scheduled tree, hyst swept from 1 to that depth). An MTPC head queries them one after another, each a sequential "
                        "circuit query per step; 1 costs none (the tree's first query)")
    p.add_argument("--ema-alphas", default="0.5,0.8,0.9",
                   help="hyst: also sweep each pair on the EMA signal (the target's top-1 probability averaged "
                        "over the generated tokens, weight alpha on the old value) with these alphas; the faster "
                        "signal is kept. '' = the path value only; gated_lora and probe only (default: %(default)s)")
    p.add_argument("--pool-speed", type=float, default=0.8,
                   help="the schedules may also use trees of the tau frontier whose simulated tokens/s is at least "
                        "this share of the best tree's (they join the bank)")
    p.add_argument("--pool-size", type=int, default=4, help="at most this many trees per task for the schedules")
    p.add_argument("--cache-len", type=int, default=200, help="KV-cache length the step costs are timed on")
    p.add_argument("--rounds", type=int, default=7, help="timing rounds of the step costs (median; first is warm-up)")
    p.add_argument("--step-costs", choices=["curve", "measured"], default="curve",
                   help="how a tree's forward is priced: curve = read off the cost curve of the forwards' rows "
                        "(every shape with the same rows pooled, the medians made non-decreasing in the work), "
                        "measured = that shape's own median (noisier: trees whose taus differ by less than the "
                        "timing noise get reordered by it) (default: %(default)s)")
    p.add_argument("--linear", choices=LINEARS, default="auto",
                   help="the targets' linear layers, as eval/bench.py --linear (price the trees on the kernels the "
                        "bench will decode with): auto = the per-machine kernel plan (a GPU: fused F.linear products), "
                        "onednn, stock = torch's layers (default: %(default)s)")
    p.add_argument("--retune", action="store_true",
                   help="with --linear auto: measure the kernel plans again (and cache them)")
    p.add_argument("--calibrations", default="",
                   help="a file for the calibration pass (step 1): read it when it exists (made with the same "
                        "options and prompts, else refused), write it when it does not; then growth, pricing and "
                        "the schedules run again without decoding the prompts")
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
    args.blocks = list(dict.fromkeys(b.strip() for b in args.blocks.split(",")))
    for b in args.blocks:
        if b not in BLOCKS:
            p.error(f"--blocks {b!r}: each placement must be one of {', '.join(BLOCKS)}")
    if args.method == "mtpc" and args.blocks != ["chain"]:
        p.error("--blocks: an MTPC head's trees carry no mask blocks")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(0)
    base, tokenizer = load_backbone(args.backbone, dtype=args.dtype, device=args.device)
    eos = eos_token_ids(base, tokenizer)
    subject = SUBJECTS[args.method](args, base)
    k = subject.k
    limit = None if args.limit is None else args.limit + args.skip
    prompts = load_prompts(args.data, limit, None, tokenizer,
                           base.config.max_position_embeddings - args.max_new_tokens - k - 1)
    tasks: dict[str, list[dict]] = {}
    for prompt in prompts:
        tasks.setdefault(prompt["category"], []).append(prompt)
    tasks = {t: items[args.skip:][: args.per_category] for t, items in tasks.items()}
    ar = Target(base)
    cals: dict[str, list[Calibration]] = {}
    held: dict[str, list[tuple[dict, Calibration, list[int]]]] = {}
    key = calibration_key(args, tasks, base.dtype) if args.calibrations else None  # (reads every file of the head)
    read = bool(args.calibrations) and Path(args.calibrations).is_file()
    if read:
        cals, held = load_calibrations(args.calibrations, key)
        print(f"tree_frontier: the calibration pass read from {args.calibrations}")
    for task, items in tasks.items():
        if task in cals:
            continue
        if len(items) <= args.holdout:
            sys.exit(f"tree_frontier: task {task} has {len(items)} prompts, --holdout {args.holdout} leaves none")
        cals[task], held[task] = [], []
        for i, prompt in enumerate(tqdm(items, desc=f"calibrate {task}", unit="prompt")):
            cont = decode(ar, Drafter(), prompt["ids"], args.max_new_tokens, eos_token_ids=eos,
                          **sampling(args, ar.device, i)).tokens
            cal = subject.calibrate(prompt["ids"] + cont, len(prompt["ids"]), task)
            if i < len(items) - args.holdout:
                cals[task].append(cal)
            else:
                held[task].append((prompt, cal, cont))
    if args.calibrations and not read:
        save_calibrations(args.calibrations, key, cals, held)

    # grow per task and placement; the budget-sized trees are candidates for the bank
    trees: list[Topology] = []
    by_paths: dict[tuple, int] = {}
    grown_of: dict[str, list[int]] = {}
    suffix = {b: "" if b == args.blocks[0] else f"_{b}" for b in args.blocks}  # names stay unique
    for task, task_cals in cals.items():
        grown_of[task] = []
        for blocks in args.blocks:
            grown = [] if subject.chains_only else grow(task_cals, k, max(args.budgets), args.max_rank, blocks)
            for t in grown:
                if t.num_nodes not in args.budgets:
                    continue
                key = (tuple(t.paths), blocks)
                if key not in by_paths:
                    by_paths[key] = len(trees)
                    trees.append(Topology(t.paths, blocks, name=f"t{len(trees)}_{t.num_nodes}n{suffix[blocks]}"))
                grown_of[task].append(by_paths[key])
    chains = []  # top-1 chains of every depth, for reference (quadratic / linear decoding's drafts)
    for blocks in args.blocks:
        for depth in range(1, k + 1):
            chain = Topology(f"chain{depth}", blocks, name=f"chain{depth}{suffix[blocks]}")
            key = (tuple(chain.paths), blocks)
            if key not in by_paths:
                by_paths[key] = len(trees)
                trees.append(chain)
            chains.append(by_paths[key])

    target = subject.target
    mean_prompt = round(statistics.mean(c.prompt_len for cs in cals.values() for c in cs))
    costs, measured = step_costs(target, trees, k, mean_prompt, args.cache_len, args.rounds, subject.candidates,
                                 subject.masks, curve=args.step_costs == "curve")

    report = {"backbone": args.backbone, "method": args.method, **subject.settings, "k": k,
              "device": str(target.device), "dtype": str(target.dtype).removeprefix("torch."),
              "blocks": ",".join(args.blocks), "max_new_tokens": args.max_new_tokens,
              "temperature": args.temperature, "top_p": args.top_p, "linear": args.linear,
              "kernels": kernel_summary(subject.kernels), "step_costs": args.step_costs,
              "costs_ms": {n: round(1e3 * v, 3) for n, v in costs.items()},
              "measured_ms": {n: round(1e3 * v, 3) for n, v in measured.items()},
              "tasks": {}, "command": "python eval/tree_frontier.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    bank_ids: set[int] = set()
    task_frontiers = {}
    for task, task_cals in cals.items():
        rows = []
        candidates = list(dict.fromkeys(grown_of[task] + chains))
        for i in candidates:
            sim = rollout(task_cals, trees, k, Schedule("static", [i]))
            rows.append({"tree": i, "name": trees[i].name, "nodes": trees[i].num_nodes,
                         "rows": trees[i].rows(trees[i].depth if subject.masks else 0), "depth": trees[i].depth,
                         "sim_tau": round(sim.tau, 4),
                         "sim_tokens_per_s": round(tokens_per_s(sim, task_cals, costs, trees), 2)})
        ar_speed = sum(c.n for c in task_cals) / (len(task_cals) * costs["prefill"]
                                                 + sum(c.n - 1 for c in task_cals) * costs["ar"])
        kept, pool = schedule_pool([trees[i] for i in candidates], [r["sim_tokens_per_s"] for r in rows],
                                   [r["sim_tau"] for r in rows], args.pool_speed, args.pool_size)
        kept, pool = [candidates[i] for i in kept], [candidates[i] for i in pool]
        task_frontiers[task] = pool
        bank_ids.update(pool + kept)  # the whole throughput frontier, even where the pool is capped
        report["tasks"][task] = {"prompts": len(task_cals), "sim_ar_tokens_per_s": round(ar_speed, 2),
                                 "trees": rows, "frontier": kept}
    # the bank: frontier trees of every task, renumbered
    order = sorted(bank_ids, key=lambda i: (trees[i].num_nodes, i))
    renumber = {old: new for new, old in enumerate(order)}
    bank = [trees[i] for i in order]
    schedules = {}
    for task, task_cals in cals.items():
        task_trees = [renumber[i] for i in task_frontiers[task]]
        schedules[task] = calibrate_schedules(task_cals, bank, task_trees, k, costs, args.hyst_ratio, args.value_depth,
                                               args.ema_alphas)
        report["tasks"][task]["schedules"] = schedules[task]
        bounds = [oracle(task_cals, bank, task_trees, costs, ar_steps) for ar_steps in (False, True)]
        if bounds[0] is not None:
            report["tasks"][task]["oracle"], report["tasks"][task]["oracle_ar"] = bounds
        for row in report["tasks"][task]["trees"]:
            row["bank"] = renumber.get(row.pop("tree"))
        report["tasks"][task]["frontier"] = [renumber[i] for i in report["tasks"][task]["frontier"]]
        report["tasks"][task]["pool"] = task_trees
    report["trees"] = [t.to_json() for t in bank]
    report["switch_cost"] = switch_cost(bank, k, args.cache_len, target.dtype)
    report["schedules"] = schedules

    if args.holdout and args.check_trees > 0:
        extra = sorted((t for i, t in enumerate(trees) if i not in bank_ids), key=lambda t: t.num_nodes)
        checked = bank + extra[: max(0, args.check_trees - len(bank))]
        report["check"] = check(subject, checked, held, args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    plot(report, out.with_suffix(".png"))
    print(markdown(report))
    return report


@dataclass
class Subject:
    """The drafter whose trees are searched: masks per block `k`, its teacher-forced pass, the
    target its steps are timed on, and a drafter decoding with tree `index` of a bank file."""
    k: int
    calibrate: Callable[[list[int], int, str], Calibration]
    target: Target
    drafter: Callable[[str, int], tuple[Drafter, Target]]
    candidates: Callable
    """the drafter's `candidates(step, rows, compiled)`: a tree's tokens from a mask block"""
    settings: dict
    masks: bool = True
    """whether a step carries mask blocks (False: MTPC, whose next tree comes from the last state)"""
    kernels: dict | None = None
    """`pack_targets`' record: the kernel plans the targets were packed and tuned with (None: none)"""
    chains_only: bool = False
    """only chains are simulated (MTPC under sampling, `rollout_sampled`): no tree growth"""


def gated_subject(args, base) -> Subject:
    from mtpkit.models.gated_lora.drafter import GatedLoRADraftConfig, GatedLoRADrafter

    if not args.head:
        sys.exit("tree_frontier: --method gated_lora needs --head DIR (a gated-LoRA head folder)")
    model = load_head(args.head, copy.deepcopy(base)).to(base.device).eval()  # the head's weights load on the CPU
    lean = _lean(model)
    # the drafter resolves --sampler (auto: the sampler when the head has one) and refuses 1 without
    # one; its candidates time drafting
    try:
        plain = GatedLoRADrafter(GatedLoRADraftConfig(head=args.head, sampler=args.sampler), model=lean)
    except ValueError as e:
        sys.exit(f"tree_frontier: --sampler {args.sampler}: {e}")
    sampler = plain.use_sampler
    adapted = plain.adapt(None, {})
    kernels = pack_targets(base, [adapted[0]], args.linear, retune=args.retune)  # `model` (calibration) stays as trained
    target = Target(*adapted)

    def drafter(bank: str, index: int):  # decodes on the same adapted copy, so on `target`
        return GatedLoRADrafter(GatedLoRADraftConfig(tree=bank, index=index, sampler=args.sampler),
                                model=lean), target

    return Subject(model.config.k,
                   lambda ids, P, task: calibrate(model, ids, P, task, sampler, args.max_rank),
                   target, drafter, plain.candidates,
                   {"head": args.head, "sampler": sampler}, kernels=kernels)


def probe_subject(args, base) -> Subject:
    from mtpkit.models.probe import ProbeConfig, ProbeDrafter

    k = args.masks or 3
    options = dict(masks=k, init=args.init, lam=args.lam)
    kernels = pack_targets(base, (), args.linear, retune=args.retune)
    plain = Target(base)
    probe = ProbeDrafter(ProbeConfig(tree=f"chain{k}", **options))

    def drafter(bank: str, index: int):
        return ProbeDrafter(ProbeConfig(tree=bank, index=index, **options)), plain

    return Subject(k, lambda ids, P, task: calibrate_probe(plain, probe, ids, P, task, args.max_rank),
                   plain, drafter, probe.candidates,
                   {"head": f"probe (init {args.init}, lambda {args.lam})", "sampler": False}, kernels=kernels)


def mtpc_subject(args, base) -> Subject:
    from mtpkit.models.mtpc.drafter import MTPCDraftConfig, MTPCDrafter
    from mtpkit.models.mtpc.head import load_head as load_mtpc_head

    if not args.head:
        sys.exit("tree_frontier: --method mtpc needs --head DIR (an MTPC head folder)")
    model = load_mtpc_head(args.head, base).to(base.device).eval()
    depth = args.max_depth or min(8, model.cfg.n)
    if not 0 < depth <= model.cfg.n:
        sys.exit(f"tree_frontier: --max-depth {depth}: the head's window is {model.cfg.n}")
    kernels = pack_targets(base, (), args.linear, retune=args.retune)
    target = Target(base)
    timed: dict[str, MTPCDrafter] = {}

    def drafter(bank: str, index: int):
        return MTPCDrafter(MTPCDraftConfig(tree=bank, index=index), model=model), target

    def candidates(step, rows, compiled):  # the drafter's own tree drafting from the root's state (greedy or sampled)
        tree = compiled.topology
        if tree.name not in timed:
            timed[tree.name] = MTPCDrafter(MTPCDraftConfig(tree=json.dumps([list(p) for p in tree.paths])), model=model)
            timed[tree.name].sampling = args.temperature > 0
            timed[tree.name].begin(target, [])
        d = timed[tree.name]
        d.e, d.given = step.hidden[0], []
        return d.propose([]).tokens.tolist()

    return Subject(depth, lambda ids, P, task: calibrate_mtpc(model, target, ids, P, task, depth, args.max_rank,
                                                              temperature=args.temperature, top_p=args.top_p),
                   target, drafter, candidates, {"head": args.head, "sampler": False, "arch": model.cfg.arch},
                   masks=False, chains_only=args.temperature > 0, kernels=kernels)


SUBJECTS = {"gated_lora": gated_subject, "probe": probe_subject, "mtpc": mtpc_subject}


def _lean(model):
    """The lean inference form (`to_inference`) of a copy of the gated model, as the bench decodes."""
    from mtpkit.models.gated_lora.inference import to_inference

    return to_inference(copy.deepcopy(model))


def sampling(args, device, i: int, offset: int = 0) -> dict:
    """decode()'s sampling arguments for prompt i: none when greedy; else --temperature / --top-p
    and a generator seeded --seed + offset + i."""
    if not args.temperature:
        return {}
    return {"temperature": args.temperature, "top_p": args.top_p,
            "generator": torch.Generator(device).manual_seed(args.seed + offset + i)}


def check(subject: Subject, bank: list[Topology], held, args) -> dict:
    """Every bank tree decoded on the held-out prompts, its decoded tau against the simulated tau
    on the same prompts. Greedy: outputs checked against AR. Under sampling (--temperature):
    the simulated tau is the rollout of the calibration's own sampled continuation (another draw
    from the same distribution); and the replay: the rollout of a calibration on the decoder's
    own output must take exactly the decoder's steps (a tree's drafts are one-hot, so a node is
    accepted iff the sampled token is its token: the steps are a function of the output)."""
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        bank_file = Path(tmp) / "bank.json"
        bank_file.write_text(json.dumps({"trees": [t.to_json() for t in bank], "schedules": {}}))  # static, index=i
        for i, tree in enumerate(tqdm(bank, desc="check", unit="tree")):
            drafter, target = subject.drafter(str(bank_file), i)
            tokens = calls = 0
            sim_cals, replay_cals, differ = [], [], []
            for j, (prompt, cal, cont) in enumerate(p for items in held.values() for p in items):
                got = decode(target, drafter, prompt["ids"], cal.n, **sampling(args, target.device, j, offset=10_000))
                if args.temperature:
                    replay_cals.append(subject.calibrate(prompt["ids"] + got.tokens, len(prompt["ids"]), cal.task))
                elif got.tokens != cont[: cal.n]:  # reported, not fatal: a GPU's low-precision ties may flip
                    differ.append(prompt["id"])
                    print(f"WARNING: tree {tree.name}: decoded output differs from AR on {prompt['id']}",
                          file=sys.stderr)
                tokens += len(got.tokens)
                calls += got.target_calls
                sim_cals.append(cal)
            sim = rollout(sim_cals, [tree], subject.k)
            decoded = tokens / calls
            row = {"tree": i, "name": tree.name, "nodes": tree.num_nodes, "decoded_tau": round(decoded, 4),
                   "sim_tau": round(sim.tau, 4), "error": round(sim.tau / decoded - 1, 4),
                   "differs_from_ar": differ}
            if args.temperature:
                replay = rollout(replay_cals, [tree], subject.k)
                row["replay_steps"], row["decoded_steps"] = round(replay.steps / replay.replicas, 2), calls
                if subject.chains_only:  # MTPC: the expected steps given the output, not its steps
                    row["replay_error"] = round(row["replay_steps"] / calls - 1, 4)
            rows.append(row)
    worst = max(abs(r["error"]) for r in rows)
    out = {"prompts": sum(len(v) for v in held.values()), "trees": rows, "max_abs_error": worst,
           "matches_ar": not any(r["differs_from_ar"] for r in rows)}
    if args.temperature and subject.chains_only:
        out["replay_max_abs_error"] = max(abs(r["replay_error"]) for r in rows)
    elif args.temperature:
        out["replay_exact"] = all(r["replay_steps"] == r["decoded_steps"] for r in rows)
    return out


def markdown(report: dict) -> str:
    decoding = (f"speculative sampling at T = {report['temperature']}, top-p {report['top_p']}"
                if report.get("temperature") else "greedy decoding")
    head = {"gated_lora": "sampler head" if report["sampler"] else "base head", "probe": "mask logits",
            "mtpc": "the circuit's exact conditionals"}[report["method"]]
    shape = ("trees at most k bytes deep, no mask blocks, Algorithm 2's cycle" if report["method"] == "mtpc" else
             f"blocks = {report['blocks']}, as many masks per block as the tree has levels")
    lines = [f"Draft trees of {report['head']} on {report['backbone']} (k = {report['k']}, "
             f"{head}, {shape}); simulated {decoding}, step costs "
             f"{'read off the cost curve of the forwards measured' if report.get('step_costs') == 'curve' else 'measured'} on "
             f"{report.get('device', 'cpu')} in {report.get('dtype', 'float32')} on {kernels_line(report)} (ms: AR "
             f"{report['costs_ms']['ar']}, prefill {report['costs_ms']['prefill']})", "",
             "Per-step cost of a tree switch (median us): choosing the tree {choose_tree_us}, its attention mask from "
             "the bank's precompiled layout {mask_from_bank_us}, the same mask with the layout rebuilt "
             "{mask_rebuilt_us}".format(**report["switch_cost"]), ""]
    for task, t in report["tasks"].items():
        lines += [f"**{task}** ({t['prompts']} prompts; simulated AR {t['sim_ar_tokens_per_s']} tok/s)", "",
                  "| tree | nodes | rows/step | sim tau | sim tok/s | vs AR | bank |", "|---|---|---|---|---|---|---|"]
        for r in t["trees"]:
            lines.append(f"| {r['name']} | {r['nodes']} | {r['rows']} | {r['sim_tau']:.3f} | {r['sim_tokens_per_s']:.1f} "
                         f"| {r['sim_tokens_per_s'] / t['sim_ar_tokens_per_s']:.2f}x | {'' if r['bank'] is None else r['bank']} |")
        lines += ["", "| schedule | trees | thresholds | sim tau | sim tok/s |", "|---|---|---|---|---|"]
        for name, s in t["schedules"].items():
            if s.get("signal") == "ema":
                name = f"{name} (EMA of the target's top-1, alpha {s['alpha']})"
            elif s.get("value_depth"):
                name = f"{name} (path value {s['value_depth']} deep)"
            thresholds = [round(x, 4) for x in s["thresholds"]]
            if s["kind"] == "hyst" and s["thresholds"][1] >= NEVER:
                thresholds = f"{thresholds}: never on, no threshold paid"
            lines.append(f"| {name} | {s['trees']} | {thresholds} | {s['sim_tau']:.3f} | {s['sim_tokens_per_s']:.1f} |")
        static = t["schedules"]["static"]["sim_tokens_per_s"]
        signals = t["schedules"].get("hyst", {}).get("by_signal")
        if signals:
            lines += ["", "Hyst's best pair on each signal: " + ", ".join(
                f"{'path value' if name == 'path' else 'EMA (alpha ' + str(b['alpha']) + ')'} "
                f"{b['sim_tokens_per_s']:.1f} tok/s ({b['sim_tokens_per_s'] / static:.3f}x static, trees {b['trees']})"
                for name, b in signals.items()) + "."]
        if "oracle" in t:
            o, oa = t["oracle"], t["oracle_ar"]
            lines += ["", f"The future known (an upper bound of every schedule over this task's trees, reached with "
                          f"trees {o['trees']} on {o['block']}-mask blocks): "
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


if __name__ == "__main__":
    run_script(main)
