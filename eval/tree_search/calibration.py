"""The calibration pass of the tree search (`eval/tree_frontier.py`, step 1): one teacher-forced
pass per prompt, from which every tree's decoding is replayed (`mtpkit.eval.tree_search.simulate`).

For each prompt: the target's greedy continuation (`--max-new-tokens`; with `--temperature T` its
sampled continuation), then one forward over prompt + continuation with a block of k masks after
every generated position (the training layout, `mtpkit.data.mtp`), reading for every position t
and depth d the rank of the true token x[t+1+d] among the head's candidates (the base head's
W z_d, or the sampler's W MLP([E(x[t+d]); z_d]) given the true parent), the target's top-1
probability at t and the base head's top-1 probability at every mask (the path value's factors).
The probe: the same pass on the plain target with the probe's synthesised mask embeddings
(`calibrate_probe`). MTPC: the circuit of every position's state over its window, the rank of
each true byte in the exact conditional given the true bytes before it, and the top-1
conditionals along the circuit's own top-1 chain (`calibrate_mtpc`). Medusa and Hydra heads: the
target's state at every position, the rank of each true token among each head's candidates and
the heads' top-1 probabilities along their own greedy chain (`calibrate_heads`).

`calibrate_tasks` runs the pass over every task's prompts (the last `--holdout` of each kept
apart for the check); `--calibrations FILE` keeps it (`save_calibrations`, `load_calibrations`)
so growth, pricing and the schedules can run again, on this machine or another, without
decoding the prompts.
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from mtpkit.data.chat import IGNORE
from mtpkit.data.mtp import collate_cached, mask_inputs
from mtpkit.models.decoding.decoder import Target, decode
from mtpkit.models.decoding.drafter import Drafter
from mtpkit.models.schedules import entropy

MISS = 1 << 20  # rank of a true token outside the head's top `--max-rank` (or past the end)


@dataclass
class Calibration:
    """One prompt's teacher-forced pass: n generated tokens; for anchor j (position P - 1 + j,
    j < n) ranks[j, d-1] = rank of the true token at depth d in the head's candidates of the block
    after that position, target_top1[j] = the target's top-1 probability there (target_entropy[j]
    its entropy) and head_top1[j, d-1] = the base head's top-1 probability at mask d."""
    task: str
    prompt_len: int
    n: int
    ranks: torch.Tensor       # [n, k] long
    target_top1: torch.Tensor  # [n]
    head_top1: torch.Tensor    # [n, k]
    cycle: str = "block"
    """how decoding moves on: "block" (a mask-token drafter: the block after the deepest accepted
    node drafts the next tree), "heads" (Medusa, Hydra: the deepest accepted node's state drafts
    the next tree, whatever node it is; `calibrate_heads`) or "alg2" (MTPC, `calibrate_mtpc`)"""
    accept: torch.Tensor | None = None
    """MTPC under speculative sampling only, [n, W]: accept[j, i-1] = min(1, q(y | ...) / p(y | ...))
    for the true byte y at window position i of anchor j, the probability that the verifier
    accepted a draft there given that the output is y (None: greedy, `ranks` decide)"""
    head_top1_kept: torch.Tensor | None = None
    """MTPC under sampling, [n, k]: head_top1 with the true byte at window position 1 kept (the
    path value after a rejection, whose bonus the next window is conditioned on)"""
    window: int = 0
    """MTPC: the head's window n (a kept byte leaves n - 1 positions to draft)"""
    target_entropy: torch.Tensor | None = None
    """[n]: the entropy (nats) of the target's distribution at anchor j, the block-start entropy
    of the `entropy` signal (`mtpkit.models.trees`; None: a calibration file made before it)"""


@torch.no_grad()
def calibrate(model, ids: list[int], prompt_len: int, task: str, sampler: bool, max_rank: int,
              chunk: int = 256) -> Calibration:
    """The pass for `ids` = prompt + the target's greedy continuation, on a GatedMTP."""
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
    return Calibration(task, prompt_len, n, ranks, target_top1.cpu(), head_top1,
                       target_entropy=entropy(target_logits).cpu())


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
    """The pass for the probe (`mtpkit.models.probe`) on the plain `target`: the
    masks after the anchor at position P - 1 + j carry the probe's embeddings after the first j
    generated tokens (its prompt init, then Eq. 4 once per token); `drafter` a `ProbeDrafter` with
    k masks per block. Decoding feeds a step's masks the embeddings as they were at the step's
    root, so after an accepted draft of L tokens they are L updates behind these (lambda = 0.1:
    the held-out check measures what that costs)."""
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
    target_logits = target.lm_head(out.last_hidden_state[0, prompt_len - 1: len(ids) - 1]).float()  # [n, V]
    target_top1 = torch.softmax(target_logits, -1).amax(-1)
    ranks, head_top1 = rank_masks(target.lm_head, z, batch["labels"][0], k, max_rank, chunk=chunk)
    return Calibration(task, prompt_len, n, ranks, target_top1.cpu(), head_top1,
                       target_entropy=entropy(target_logits).cpu())


@torch.no_grad()
def calibrate_mtpc(model, target: Target, ids: list[int], prompt_len: int, task: str, depth: int, max_rank: int,
                   chunk: int = 64, temperature: float = 0.0, top_p: float = 1.0) -> Calibration:
    """The pass for an MTPC head (`mtpkit.models.mtpc`, Algorithm 2's cycle): for anchor j
    (position t = P - 1 + j) the circuit of e_t (`MTPCModel.features`: the final state, or the
    draft layers') over its window; ranks[j, d-1] = the rank of the true byte x[t+d] in the
    circuit's exact conditional given the true bytes x[t+1..t+d-1] (ties as the drafter's stable
    sort breaks them: the lower byte first), head_top1[j, d-1] = the circuit's top-1 conditional
    probability at position d along its own top-1 chain (`draft_trees.chain_value`),
    target_top1[j] = the target's top-1 probability at t. With `temperature` > 0 (speculative
    sampling, `ids` the target's own sample) also `accept` (the per-byte acceptance probability
    given the output, up to window position depth + 1) and `head_top1_kept`."""
    from mtpkit.models.generate import target_probs
    from mtpkit.models.mtpc.circuits import next_log_probs_posterior
    from mtpkit.models.mtpc.draft_trees import chain_log_top1

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
                       accept=accept if sampled else None, head_top1_kept=kept if sampled else None, window=span,
                       target_entropy=entropy(logits).cpu())


@torch.no_grad()
def calibrate_heads(heads, target: Target, ids: list[int], prompt_len: int, task: str, max_rank: int,
                    chunk: int = 256) -> Calibration:
    """The pass for Medusa or Hydra heads (`mtpkit.models.medusa`): for anchor j (position t =
    P - 1 + j) the target's last hidden state h_t; ranks[j, d-1] = the rank of the true token
    x[t+1+d] among head d's candidates (Medusa: from h_t alone; Hydra: given the true tokens
    x[t+1..t+d], the bonus first, which is the path a matching tree node sits on),
    head_top1[j, d-1] = head d's top-1 probability along the heads' greedy chain (the path value's
    factor, as the drafter computes it: Medusa's head d at h_t; Hydra's given the bonus x[t+1] and
    the chain's own top-1 tokens before it), target_top1[j] = the target's top-1 probability at t.
    The heads draft from the deepest accepted node's state after every step, so every node of a
    tree drafts the next one (cycle "heads")."""
    device = target.device
    x = torch.tensor(ids, device=device)
    n, P, K = len(ids) - prompt_len, prompt_len, heads.cfg.heads
    states = target.body(input_ids=x[None]).last_hidden_state  # [1, T, d]
    target_logits = target.lm_head(states[0, P - 1: P - 1 + n]).float()  # [n, V]
    target_top1 = torch.softmax(target_logits, -1).amax(-1).cpu()
    h = heads.prefix_states(states)[0, P - 1: P - 1 + n]  # [n, d]: what the heads read (Hydra++: the prefix layer's)
    padded = torch.cat([x, x.new_zeros(K + 1)])
    ranks = torch.full((n, K), MISS, dtype=torch.long)
    head_top1 = torch.zeros(n, K)
    for s in range(0, n, chunk):
        rows = torch.arange(s, min(s + chunk, n), device=device)
        t = P - 1 + rows
        chain = padded[t + 1][:, None]  # Hydra's greedy chain: the bonus, then the heads' top-1 tokens
        for d in range(1, K + 1):
            prev = torch.stack([padded[t + i] for i in range(1, d + 1)], -1) if heads.hydra else None
            logits = heads.logits(d - 1, heads.hidden(d - 1, h[rows], prev), target.lm_head).float()  # [B, V]
            y = padded[t + 1 + d]
            r = (logits > logits.gather(1, y[:, None])).sum(-1)
            valid = rows + d < n  # x[t+1+d] is a generated token
            ranks[rows.cpu(), d - 1] = torch.where(valid & (r < max_rank), r, torch.full_like(r, MISS)).cpu()
            if heads.hydra and d > 1:  # head d on its own chain, not on the true tokens
                logits = heads.logits(d - 1, heads.hidden(d - 1, h[rows], chain), target.lm_head).float()
            top = torch.softmax(logits, -1).max(-1)
            head_top1[rows.cpu(), d - 1] = top.values.cpu()
            chain = torch.cat([chain, top.indices[:, None]], -1)
    return Calibration(task, prompt_len, n, ranks, target_top1, head_top1, cycle="heads",
                       target_entropy=entropy(target_logits).cpu())


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
    if getattr(args, "method", None) == "hydra":  # head_top1 along the heads' own greedy chain (older files: true tokens)
        key["hydra_top1"] = "greedy chain"
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


def sampling(args, device, i: int, offset: int = 0) -> dict:
    """decode()'s sampling arguments for prompt i: none when greedy; else --temperature / --top-p
    and a generator seeded --seed + offset + i."""
    if not args.temperature:
        return {}
    return {"temperature": args.temperature, "top_p": args.top_p,
            "generator": torch.Generator(device).manual_seed(args.seed + offset + i)}


def calibrate_tasks(subject, ar: Target, tasks: dict[str, list[dict]], args, eos: set[int]) -> tuple[dict, dict]:
    """(calibrations, held-out) of every task: each prompt's continuation decoded by plain AR, then
    `subject.calibrate`d; the last `args.holdout` prompts of a task go to held-out, as
    (prompt, calibration, continuation). With `args.calibrations`, read from that file when it
    exists (refused when made with other options or prompts), else written to it."""
    cals: dict[str, list] = {}
    held: dict[str, list] = {}
    key = calibration_key(args, tasks, ar.dtype) if args.calibrations else None  # (reads every file of the head)
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
    return cals, held
