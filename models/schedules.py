"""Run-time policies that pick a bank tree (`mtpkit.models.trees.TopologyBank`) each step.

Policies (after "EntMTP: Accelerating LLM Inference with Entropy Guided Multi Token
Prediction", Chen, arXiv:2606.27550) map a per-step feature the verifier already has, the path value v (the
target's top-1 probability at the last accepted node times the head's top-1 probability at each
depth, a product that is high where the head chain is confident; a schedule's `value_depth` V > 0
keeps the first V depths only, which MTPC uses to skip the sequential queries of a deep chain),
to an index into the bank:

- static: always the same tree (EntMTP*, the best static tree per task);
- ladder: thresholds t_1 < ... < t_{K-1} over v select tree i for t_i <= v < t_{i+1}
  (EntMTP-ladder, trees ordered small to large);
- hyst: two trees (low, high), switch to `high` when v >= tau_on and back to `low` when
  v < tau_off, tau_off <= tau_on so one noisy step does not flap (EntMTP-tau). The paper's
  `low` is the conservative tree and `high` the aggressive one; `eval/tree_frontier.py` also
  tries the other order (a bigger step on the doubtful steps: a chain-block tree's root block
  proposes again after a rejection, which pays where the draft is likely rejected).

A schedule's `signal` says what v is (every one is higher where the draft is likelier accepted,
so the same ladder and hyst rules read each):

- `path` (the default): EAGLE-2's path value of the greedy chain at depth D, the product above,
  V_D = p_0 p_1 ... p_D (p_0 the target's top-1 probability, p_d the head's at depth d);
- `path_sum`: the sum of the chain's path values over depths 1..D, V_1 + ... + V_D (under
  independent acceptance, the expected number of drafts the chain gets accepted);
- `entropy`: the smoothed block-start entropy of EntMTP's Appendix A, H = the entropy (nats) of
  the target's distribution at the last accepted node (the row the bonus came from: the position
  the next block starts after), averaged H' <- alpha H' + (1 - alpha) H once per tree choice;
  v = exp(-H') in (0, 1], so a threshold t on v is H' <= -ln t;
- `accept`: the EMA of the accept length of Appendix A, a = the tokens a drafted step added (its
  accepted drafts and the bonus), a' <- alpha a' + (1 - alpha) a after every drafted step; v = a'
  (no drafted step yet: the schedule keeps its first tree);
- `ema`: the exponential moving average of the target's top-1 probability over the tokens
  generated so far (v <- alpha v + (1 - alpha) p per token, p read off the verifier's rows that
  predicted the step's tokens: the root and the accepted nodes).

EntMTP's Section 4 names the path values the policy's features and its scalar "monotone in the
verifier's expected accept length"; whether that scalar is V_D or the sum over depths is not
recoverable from the text (its formulas are lost), hence both. `entropy`, `accept` and `ema` are
for the mask-token drafters (gated LoRA, the probe), and all but `ema` for Medusa and Hydra heads
(`mtpkit.models.medusa.drafter`); MTPC schedules read `path` or `path_sum`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mtpkit.models.trees import TreeOptions

SCHEDULES = ("static", "ladder", "hyst")
SIGNALS = ("path", "path_sum", "entropy", "accept", "ema")
SMOOTHED = ("entropy", "accept", "ema")
"""signals that are running averages (weight `alpha` on the old value)"""


def path_signal(signal: str, target_top1: float, head_top1: list[float]) -> float:
    """The chain's scalar from its factors: the target's top-1 probability p_0 and the head's top-1
    probabilities p_1..p_D along its greedy chain. EAGLE-2's path value at depth d is
    V_d = p_0 p_1 ... p_d; `path` is V_D (p_0 alone for D = 0), `path_sum` is V_1 + ... + V_D."""
    value, total = float(target_top1), 0.0
    for p in head_top1:
        value *= float(p)
        total += value
    if signal == "path":
        return value
    if signal == "path_sum":
        return total
    raise ValueError(f"path_signal: {signal!r} is not a path signal (path, path_sum)")


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """The entropy (nats) of softmax(logits) over the last dimension: [..., V] -> [...]."""
    logp = torch.log_softmax(logits.float(), -1)
    return -(logp.exp() * logp).sum(-1)


@dataclass
class Schedule:
    """Which tree of a bank each step uses (see the module docstring). `thresholds`: ladder,
    K - 1 ascending values of the path value v; hyst: (tau_off, tau_on) with `trees` = (low, high)
    bank indices, `low` used below tau_on; static: `trees` = (index,)."""
    kind: str = "static"
    trees: list[int] = field(default_factory=lambda: [0])
    thresholds: list[float] = field(default_factory=list)
    value_depth: int = 0
    """depths of the head's chain in the path value (0: as deep as the deepest scheduled tree)"""
    signal: str = "path"
    """what the thresholds compare (the module docstring): path (the path value at depth D),
    path_sum (the path values summed over depths 1..D), entropy (exp of minus the smoothed
    block-start entropy), accept (the EMA of the accept length) or ema (the EMA of the target's
    top-1 probability over the generated tokens)"""
    alpha: float = 0.0
    """entropy, accept, ema: the weight of the running average on the old value, in [0, 1)
    (0: the last observation alone)"""

    def __post_init__(self):
        if self.kind not in SCHEDULES:
            raise ValueError(f"tree schedule must be one of {SCHEDULES}, got {self.kind!r}")
        if self.signal not in SIGNALS:
            raise ValueError(f"tree schedule signal must be one of {SIGNALS}, got {self.signal!r}")
        if not 0.0 <= self.alpha < 1.0:
            raise ValueError(f"tree schedule: alpha {self.alpha} must be in [0, 1)")
        if self.kind == "ladder" and len(self.thresholds) != len(self.trees) - 1:
            raise ValueError(f"ladder schedule: {len(self.trees)} trees need {len(self.trees) - 1} thresholds, "
                             f"got {self.thresholds}")
        if self.kind == "ladder" and any(a > b for a, b in zip(self.thresholds, self.thresholds[1:])):
            raise ValueError(f"ladder schedule: thresholds {self.thresholds} must ascend")
        if self.value_depth < 0:
            raise ValueError(f"tree schedule: value_depth {self.value_depth} must be >= 0")
        if self.kind == "hyst":
            if len(self.trees) != 2 or len(self.thresholds) != 2:
                raise ValueError("hyst schedule: trees (low, high) and thresholds (tau_off, tau_on)")
            if self.thresholds[0] > self.thresholds[1]:
                raise ValueError(f"hyst schedule: tau_off {self.thresholds[0]} > tau_on {self.thresholds[1]}")

    @property
    def switches(self) -> bool:
        """Whether the tree can change between steps (so the path value is read): a ladder or a
        hyst over two different trees; hyst over one tree twice is that tree, static."""
        return self.kind != "static" and len(set(self.trees)) > 1

    def start(self) -> int:
        """Position in `trees` of the first step's tree (ladder: the smallest; hyst: `low`)."""
        return 0

    def next(self, current: int, value: float | None) -> int:
        """Position in `trees` for the next step, from the current one and the signal's value v
        (None: nothing observed yet, the current tree kept)."""
        if self.kind == "static":
            return 0
        if value is None:
            return current
        if self.kind == "ladder":
            return sum(value >= t for t in self.thresholds)
        tau_off, tau_on = self.thresholds
        if current == 0:
            return 1 if value >= tau_on else 0
        return 0 if value < tau_off else 1

    def smooth(self, ema: float | None, observed) -> float | None:
        """A smoothed signal's average after the observations `observed` (host numbers), in order,
        from `ema` (None: nothing yet, so the first observation starts it)."""
        for x in observed:
            ema = float(x) if ema is None else self.alpha * ema + (1.0 - self.alpha) * float(x)
        return ema

    def value(self, average: float | None) -> float | None:
        """v of a smoothed signal from its running average: exp(-H') for entropy, else the average."""
        if self.signal == "entropy" and average is not None:
            return math.exp(-average)
        return average

    def to_json(self) -> dict:
        out = {"kind": self.kind, "trees": list(self.trees), "thresholds": list(self.thresholds)}
        if self.value_depth:
            out["value_depth"] = self.value_depth
        if self.signal in SMOOTHED:
            out.update(signal=self.signal, alpha=self.alpha)
        elif self.signal != "path":
            out["signal"] = self.signal
        return out

    def depth_of_value(self, deepest: int) -> int:
        """Depths of the head's chain the path value multiplies, for a deepest tree of `deepest`."""
        return min(self.value_depth, deepest) if self.value_depth else deepest


def tree_schedule(options: TreeOptions, schedules: dict, n_trees: int, method: str) -> Schedule:
    """The schedule `options` ask for, from a bank's calibrated schedules. A malformed bank entry
    is a ValueError (one line)."""
    try:
        return _tree_schedule(options, schedules, n_trees, method)
    except (KeyError, IndexError, TypeError) as e:
        raise ValueError(f"{method} tree={options.tree!r:.60}: the bank's {options.schedule!r} schedule is malformed "
                         f"({type(e).__name__}: {e}); rewrite it with eval/tree_frontier.py") from None


def _tree_schedule(options: TreeOptions, schedules: dict, n_trees: int, method: str) -> Schedule:
    if options.schedule == "static":
        if options.index >= 0:
            index = options.index
        elif "static" in schedules:
            index = schedules["static"]["trees"][0]
        else:
            index = 0
        if not isinstance(index, int) or not 0 <= index < n_trees:
            raise ValueError(f"{method} index={index!r}: the bank {options.tree} has {n_trees} trees")
        return Schedule("static", [index])
    if options.schedule not in schedules:
        raise ValueError(f"{method} schedule={options.schedule}: the bank {options.tree} has no calibrated "
                         f"{options.schedule!r} schedule (has {sorted(schedules)}); run eval/tree_frontier.py")
    entry = schedules[options.schedule]  # the bank's entry also holds its simulated tau and tokens/s
    return Schedule(entry["kind"], list(entry["trees"]), list(entry.get("thresholds", [])), entry.get("value_depth", 0),
                    entry.get("signal", "path"), entry.get("alpha", 0.0))
