"""The acceptance simulator of the tree search (`eval/tree_frontier.py`, step 2): decoding
replayed on a calibration (`mtpkit.eval.tree_search.calibration`).

Greedy decoding: a step whose draft comes from the block after position t accepts the longest
path of the tree whose ranks equal the true tokens' ranks; it yields that many tokens plus the
bonus and moves to the deepest accepted node, whose own block (if the topology gives it one)
drafts the next step; without one the next step drafts nothing. So the rollout of a tree (or a
schedule switching trees by its signal, `mtpkit.models.trees`) is decoding replayed, with the same steps as
`mtpkit.models.gated_lora.drafter` takes, exact up to floating-point ties of the ranks (the
held-out check, `mtpkit.eval.tree_search.check`, measures it). Medusa and Hydra heads draft from
the deepest accepted node's state, whatever node it is (no step drafts nothing). MTPC moves on by
its Algorithm 2: no mask blocks; after an accepted draft the bonus is dropped and the last
accepted byte's state drafts next; after a rejection the bonus is kept and a one-byte forward
computes its state (a step without tokens).

Under speculative sampling the same rollout holds: a tree's drafts are one-hot (the head's
top-ranked tokens), so the verifier's recursive rejection accepts a node iff the token it
samples is that node's token, and the output follows the target's distribution. The steps are
then a function of the output, and a rollout of the target's own samples draws from the
decoder's distribution of steps (the `drafts=sample` chains, whose q is not one-hot, are not
simulated). MTPC under sampling drafts from the circuit's q, not one-hot: `rollout_sampled`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtpkit.eval.tree_search.calibration import Calibration
from mtpkit.models.schedules import Schedule, path_signal
from mtpkit.models.trees import Topology


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


def path_value(cal: Calibration, j: int, depth: int, kept: int = 0, signal: str = "path") -> float:
    """The drafters' path value at anchor j (`path_signal`: `signal` path, the product at depth
    `depth`, or path_sum, the chain's products summed over depths 1..depth; MTPC: with `kept` bytes
    kept after it, its chain `depth` bytes deep or as deep as the window leaves)."""
    head = cal.head_top1 if not kept else cal.head_top1_kept
    if cal.window:
        depth = min(depth, cal.window - kept)
    return path_signal(signal, float(cal.target_top1[j]), head[j, :depth].tolist())


def check_signal(cals: list[Calibration], schedule: Schedule) -> None:
    """Refuse (ValueError, one line) a schedule whose signal these calibrations cannot replay."""
    if not schedule.switches or schedule.signal in ("path", "path_sum"):
        return
    if schedule.signal == "ema" and any(cal.cycle != "block" for cal in cals):
        raise ValueError("signal=ema schedules are for mask-token drafters; MTPC schedules read the path value")
    if any(cal.cycle == "alg2" for cal in cals):
        raise ValueError(f"signal={schedule.signal} schedules are not simulated for MTPC (Algorithm 2's steps "
                         "without tokens); MTPC schedules read path or path_sum")
    if schedule.signal == "entropy" and any(cal.target_entropy is None for cal in cals):
        raise ValueError("signal=entropy: a calibration without the target's entropy (made before it was "
                         "recorded); calibrate again")


def rollout(cals: list[Calibration], trees: list[Topology], k: int, schedule: Schedule | None = None,
            replicas: int = 32, seed: int = 0) -> Rollout:
    """Greedy decoding replayed (the module docstring) with `schedule` over `trees`
    (None: trees[0] on every step), with blocks of as many masks as the deepest tree in use has
    levels, as the drafter does. MTPC calibrations under sampling: `rollout_sampled` (`replicas`
    decodes per calibration, acceptances drawn from `seed`)."""
    schedule = schedule or Schedule("static", [0])
    depth = max(trees[i].depth for i in schedule.trees)
    if depth > k:
        raise ValueError(f"a tree of depth {depth} needs more than the head's k={k} masks")
    check_signal(cals, schedule)
    if any(cal.accept is not None for cal in cals):
        return rollout_sampled(cals, trees, schedule, replicas, seed)
    signal = schedule.signal if schedule.switches else None
    steps = tokens = 0
    anchors, accepted, used = [], [], []
    # MTPC, Medusa and Hydra: no mask blocks (`NAME@0`)
    block = 0 if any(cal.cycle in ("alg2", "heads") for cal in cals) else depth
    for c, cal in enumerate(cals):
        ranks = cal.ranks.tolist()
        position = schedule.start()
        alg2 = cal.cycle == "alg2"
        # the prompt's forward: a mask drafter keeps its bonus; MTPC (Algorithm 2) drops it, and the
        # last prompt token's state drafts next
        bonus = 0 if alg2 else 1
        steps, tokens, gen, j, has = steps + 1, tokens + min(bonus, cal.n), bonus, 0, True
        # signal=ema: the target's top-1 probability of every generated token (token j: at anchor j)
        top1 = cal.target_top1.tolist() if signal == "ema" else []
        entropies = cal.target_entropy.tolist() if signal == "entropy" else []
        # a smoothed signal's running average: ema from the prompt forward's token on
        average = schedule.smooth(None, top1[:1])
        while gen < cal.n:
            if has:
                if signal in ("path", "path_sum"):
                    value = path_value(cal, j, schedule.depth_of_value(depth), signal=signal)
                elif signal == "entropy":  # the block-start entropy, once per tree choice
                    average = schedule.smooth(average, entropies[j: j + 1])
                    value = schedule.value(average)
                else:
                    value = schedule.value(average)
                if signal is not None:
                    position = schedule.next(position, value)
                tree = trees[schedule.trees[position]]
                L = accept_length(tree, ranks[j])
                anchors.append((c, j))
                accepted.append(L)
                used.append(schedule.trees[position])
                if alg2:  # the accepted bytes (the bonus dropped), or after a rejection the bonus alone
                    new, has = max(L, 1), L > 0
                else:  # Medusa, Hydra: every node's state drafts; a mask drafter: the nodes with a block
                    new = L + 1
                    has = cal.cycle == "heads" or (tree.index[tuple(ranks[j][:L])] if L else 0) in tree.block_nodes
                if signal == "accept":  # the drafted step's accept length: its drafts and the bonus
                    average = schedule.smooth(average, [L + 1])
            else:  # mask drafter: the root's block alone, and its bonus; MTPC: the kept bonus's state, no tokens
                L, new, has = 0, 0 if alg2 else 1, True
                used.append(None)
            if signal == "ema":  # the step's tokens j + 1 .. j + new, predicted by its root's and accepted nodes' rows
                average = schedule.smooth(average, top1[j + 1: j + 1 + new])
            steps += 1
            tokens += min(new, cal.n - gen)
            gen += new
            j += new
    return Rollout(steps, tokens, anchors, accepted, used, block)


def rollout_sampled(cals: list[Calibration], trees: list[Topology], schedule: Schedule, replicas: int,
                    seed: int) -> Rollout:
    """MTPC chains under speculative sampling (the drafter's exact Algorithm 2 cycle), `replicas`
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
                    value = path_value(cal, j, schedule.depth_of_value(deepest), m, schedule.signal)
                    position = schedule.next(position, value)
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
