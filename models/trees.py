"""Draft-tree topologies, a precompiled bank of them, and run-time policies that pick one.

A topology is a set of rank paths in the Medusa "choices" format: the path (r_1, ..., r_d) is the
draft node at depth d whose token is the r_d-th most likely candidate of the head at depth d,
under the node (r_1, ..., r_{d-1}); every prefix of a path is a node too. `[(0,), (0, 0)]` is a
chain of two (the top-1 tokens), `[(0,), (1,), (0, 0)]` branches at the first position.
Mask-token drafters also attach a block of masks to some nodes (`blocks`; as many masks as the
deepest tree in use has levels): the block after
the deepest accepted node proposes the next step's draft, so a node without one ends the
speculation after it is accepted (the next step drafts nothing, from the root's block alone).
The placements: `chain` (the root and the top-1 path: quadratic decoding's blocks on a chain),
`all`, `root`, `leaf` (the leaves only: linear decoding's single block after the last token on a
chain; the root carries none, so a step that accepts no draft is followed by one that drafts
nothing) or a list of nodes (the root always included).

`TopologyBank` holds several topologies, each precompiled for a k-mask drafter once (parents of
every step row, children lists, the tree attention layout the decoder builds its mask from), so
switching trees between steps is choosing an index. Policies (after "EntMTP: Accelerating LLM Inference with Entropy Guided Multi Token
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
for the mask-token drafters (gated LoRA, the probe); MTPC schedules read `path` or `path_sum`.
"""

from __future__ import annotations

import json
import math
from functools import lru_cache
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mtpkit.models.decoding.drafter import Draft, StepOutput
from mtpkit.models.decoding.step import StepOptions


@lru_cache(maxsize=512)
def tree_layout(parents: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Ancestor-or-self mask [Q, Q] (bool) and depth [Q] for nodes with `parents` (-1 = none).

    Cached by structure, so a static tree (same shape every step) builds its mask once; each
    step only shifts the positions by the cache length and prepends all-visible cache columns.
    """
    Q = len(parents)
    allowed = torch.zeros(Q, Q, dtype=torch.bool)
    depth = torch.zeros(Q, dtype=torch.long)
    for i, p in enumerate(parents):
        if p >= 0:
            if p >= i:
                raise ValueError(f"node {i} has parent {p}: parents must come before children")
            allowed[i] = allowed[p]
            depth[i] = depth[p] + 1
        allowed[i, i] = True
    return allowed, depth


def children_of(parents: torch.Tensor | list[int], num_nodes: int) -> list[list[int]]:
    """children[i] for step nodes 0..num_nodes-1 (root + drafts) from the draft parents (a
    tensor, or host ints)."""
    children = [[] for _ in range(num_nodes)]
    for j, p in enumerate(parents.tolist() if isinstance(parents, torch.Tensor) else parents, start=1):
        children[p].append(j)
    return children


BLOCKS = ("chain", "all", "root", "leaf")
MAX_DEPTH = 64
"""the deepest draft a tree may have (a chain of 64 drafted tokens is far past any accepted length)"""
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


def parse_paths(spec) -> list[tuple[int, ...]]:
    """Rank paths from a list of lists of ints, a JSON string of one, or `chainN` (N >= 1 top-1
    tokens). Missing prefixes are added; the result is sorted by depth, then by ranks (parents
    first). Anything else is a ValueError (one line)."""
    if isinstance(spec, str):
        text = spec.strip()
        if text.startswith("chain"):
            if not text[5:].isdigit() or not 1 <= int(text[5:]) <= MAX_DEPTH:
                raise ValueError(f"tree {spec!r:.40}: `chainN` needs a whole number 1 <= N <= {MAX_DEPTH}, e.g. chain3")
            return [(0,) * d for d in range(1, int(text[5:]) + 1)]
        try:
            spec = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as e:
            raise ValueError(f"tree {spec!r:.60}: not a JSON list of rank paths like [[0],[1],[0,0]] ({e})") from None
    if not isinstance(spec, (list, tuple)):
        raise ValueError(f"tree {spec!r:.60}: not a list of rank paths like [[0],[1],[0,0]]")
    paths = set()
    for path in spec:
        if isinstance(path, (list, tuple)) and len(path) > MAX_DEPTH:
            raise ValueError(f"tree path of depth {len(path)}: at most {MAX_DEPTH} deep")
        if (not isinstance(path, (list, tuple)) or not path
                or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in path)):
            raise ValueError(f"tree path {path!r:.60}: a path is a non-empty list of non-negative whole ranks")
        path = tuple(path)
        for d in range(1, len(path) + 1):
            paths.add(path[:d])
    return sorted(paths, key=lambda p: (len(p), p))


def check_ranks(trees: list[Topology], vocab_size: int, what: str) -> None:
    """Refuse (ValueError, one line) a tree whose ranks need more candidates than the vocabulary
    has (rank r is the (r+1)-th most likely token)."""
    width = max((t.max_rank for t in trees), default=1)
    if width > vocab_size:
        raise ValueError(f"{what}: a rank of {width - 1} needs {width} candidate tokens, the vocabulary has "
                         f"{vocab_size} (ranks are 0 .. {vocab_size - 1})")


@dataclass
class Topology:
    """One draft tree: rank paths (parents before children) and the nodes carrying a mask block.

    blocks: "chain" = the root and every node of the top-1 path (0, 0, ...), "all" = every node,
    "root" = the root only, "leaf" = every node without children (the root alone for an empty
    tree; on a chain, linear decoding's block), or an explicit list of node indices (0 = root,
    j = paths[j - 1]; the root is always added)."""
    paths: list[tuple[int, ...]]
    blocks: str | list[int] = "chain"
    name: str = ""

    def __post_init__(self):
        self.paths = parse_paths(self.paths)
        index = {p: j for j, p in enumerate(self.paths, start=1)}
        self.index = index
        self.parents = [index.get(p[:-1], 0) for p in self.paths]  # [N] draft parents (0 = root)
        self.depths = [len(p) for p in self.paths]
        self.ranks = [p[-1] for p in self.paths]
        if isinstance(self.blocks, str):
            if self.blocks not in BLOCKS:
                raise ValueError(f"tree blocks must be one of {BLOCKS} or a list of node indices, got {self.blocks!r}")
            if self.blocks == "all":
                nodes = range(len(self.paths) + 1)
            elif self.blocks == "chain":
                nodes = [0] + [j for p, j in index.items() if not any(p)]
            elif self.blocks == "leaf":
                inner = {p[:-1] for p in self.paths}
                nodes = [j for p, j in index.items() if p not in inner] or [0]
            else:
                nodes = [0]
            self.block_nodes = sorted(nodes)
        else:
            self.block_nodes = sorted({0, *map(int, self.blocks)})
            if self.block_nodes[-1] > len(self.paths):
                raise ValueError(f"tree blocks {self.blocks}: node {self.block_nodes[-1]} does not exist "
                                 f"({len(self.paths)} nodes)")
        if not self.name:
            self.name = f"{len(self.paths)}n"

    @property
    def num_nodes(self) -> int:
        return len(self.paths)

    @property
    def depth(self) -> int:
        return max(self.depths, default=0)

    @property
    def max_rank(self) -> int:
        """Candidates needed per head position: 1 + the largest rank used."""
        return 1 + max(self.ranks, default=0)

    def levels(self) -> list[tuple[list[int], list[int]]]:
        """Per depth 1..D: (its nodes, their distinct parents, ascending); node j = paths[j - 1],
        parent 0 = the root."""
        out = []
        for d in range(1, self.depth + 1):
            nodes = [j for j in range(1, self.num_nodes + 1) if self.depths[j - 1] == d]
            out.append((nodes, sorted({self.parents[j - 1] for j in nodes})))
        return out

    def rows(self, k: int) -> int:
        """Rows of a verifier step with this tree and k-mask blocks: root + nodes + masks."""
        return 1 + self.num_nodes + k * len(self.block_nodes)

    def to_json(self) -> dict:
        return {"name": self.name, "paths": [list(p) for p in self.paths],
                "blocks": self.blocks if isinstance(self.blocks, str) else list(self.block_nodes)}


@dataclass
class Compiled:
    """A topology laid out for one verifier step of a k-mask drafter (root, N drafts, masks).

    extra_parents: [M] parent (step index) of every mask; block_rows[node] = the step rows of the
    node's k masks; children: per step node; layout: (allowed [Q, Q], depth [Q]) of the step's
    tree attention, as `tree_layout` builds it (the decoder's mask comes from
    it with a cache-length shift)."""
    topology: Topology
    parents: tuple[int, ...]
    extra_parents: tuple[int, ...]
    block_rows: dict[int, list[int]]
    children: list[list[int]]
    full_parents: tuple[int, ...]
    layout: tuple[torch.Tensor, torch.Tensor]
    levels: list[tuple[list[int], list[int]]]
    """per depth 1..D: (its nodes, their distinct parents, ascending)"""


def mask_blocks(nodes, first: int, k: int) -> tuple[list[int], dict[int, list[int]]]:
    """A block of k masks after each of `nodes` (step indices), the masks numbered from step row
    `first` on: (the masks' parents, node -> its block's rows). Mask 1 hangs off its node, mask i
    off mask i-1."""
    extra_parents, block_rows = [], {}
    for j, node in enumerate(nodes):
        start = first + j * k
        block_rows[node] = list(range(start, start + k))
        extra_parents += [node] + list(range(start, start + k - 1)) if k else []
    return extra_parents, block_rows


def compile_topology(topology: Topology, k: int) -> Compiled:
    N = topology.num_nodes
    extra_parents, block_rows = mask_blocks(topology.block_nodes, N + 1, k)
    full = tuple([-1] + topology.parents + extra_parents)
    return Compiled(topology=topology, parents=tuple(topology.parents), extra_parents=tuple(extra_parents),
                    block_rows=block_rows,
                    children=children_of(topology.parents, N + 1), full_parents=full, layout=tree_layout(full),
                    levels=topology.levels())


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


class TopologyBank:
    """Topologies compiled once for a k-mask drafter; `get(i)` is a list lookup."""

    def __init__(self, topologies: list[Topology], k: int):
        if not topologies:
            raise ValueError("an empty tree bank")
        self.topologies = topologies
        self.k = k
        self.compiled = [compile_topology(t, k) for t in topologies]

    def __len__(self) -> int:
        return len(self.compiled)

    def get(self, i: int) -> Compiled:
        return self.compiled[i]


def load_bank(spec: str, task: str | None = None, blocks: str = "") -> tuple[list[Topology], dict[str, dict]]:
    """Topologies and schedules from `spec`: a bank file written by `eval/tree_frontier.py`
    (JSON: {"trees": [...], "schedules": {task: {name: schedule}}}), a file holding one tree's
    JSON list of rank paths, or one inline tree (a JSON list of rank paths, or `chainN`). Returns
    (topologies, schedules of `task` or of the first task, {} for a single tree). `blocks`: the
    mask-block placement of a single tree ('' = chain); a bank's trees carry their own."""
    path = Path(spec)
    single = blocks or "chain"
    text = spec.strip()
    if not text.startswith(("[", "chain")) and (spec.endswith(".json") or path.is_file()):
        if not path.is_file():
            raise ValueError(f"tree bank {spec}: no such file")
        try:
            data = json.loads(path.read_text())
            if isinstance(data, list):  # a file of one tree's rank paths
                return [Topology(data, single)], {}
            if blocks:
                raise ValueError(f"blocks={blocks} is for a single tree; the bank's trees carry their own blocks")
            trees = [Topology(t["paths"], t.get("blocks", "chain"), t.get("name", "")) for t in data["trees"]]
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, OSError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"tree bank {spec}: not a bank written by eval/tree_frontier.py ({e})") from None
        schedules = data.get("schedules", {})
        if not isinstance(schedules, dict) or not all(
                isinstance(v, dict) and all(isinstance(e, dict) for e in v.values()) for v in schedules.values()):
            raise ValueError(f"tree bank {spec}: \"schedules\" must map each task to its schedules (objects)")
        if task is not None and task not in schedules:
            raise ValueError(f"tree bank {spec}: no schedules for task {task!r} (has {sorted(schedules)})")
        chosen = schedules.get(task) if task else next(iter(schedules.values()), {})
        return trees, chosen or {}
    return [Topology(spec, single)], {}


@dataclass
class TreeOptions(StepOptions):
    """Draft-tree options of the mask-token drafters (`MaskTreeDrafting`) and of MTPC
    (`mtpkit.models.mtpc.drafter`, which words `tree` for its circuit)."""
    tree: str = ""
    """draft a TREE instead of the drafter's own drafts: a bank file written by
    eval/tree_frontier.py, a JSON list of rank paths such as [[0],[1],[0,0]] (inline or in a
    .json file), or chainN (N top-1 tokens); '' = the drafter's own. Tree drafts are the
    head's top-ranked tokens (deterministic, exact under sampling by the verifier's
    multi-candidate rule). A bank searched for your machine and task drafts the trees that pay there"""
    schedule: str = "static"
    """static | ladder | hyst: which of the bank's trees each step uses (mtpkit.models.trees);
    ladder and hyst read their trees, thresholds and signal from the bank's schedules for `task`,
    and switch trees per step by that signal (the path value, its sum over depths, the smoothed
    block-start entropy, the EMA of the accept length or of the target's top-1 probability):
    where the bank's simulated tokens/s says they pay"""
    task: str = ""
    """the bank's task whose calibrated schedules to use ('' = the first in the file): the one
    closest to the prompts you serve"""
    index: int = -1
    """schedule=static: the bank's tree to use (-1 = the task's calibrated static tree, or tree 0),
    e.g. to measure one tree of the bank"""
    log: str = ""
    """append one JSON line per verifier step (tree index, nodes, accepted, path value) to this
    file: to see which trees a schedule chose"""


@dataclass
class MaskTreeOptions(TreeOptions):
    """`TreeOptions` of the mask-token drafters, whose trees carry mask blocks."""
    blocks: str = ""
    """mask-block placement of a single tree (tree=chainN or rank paths): chain (the root and the
    top-1 path; quadratic decoding on a chain), all, root, or leaf (the leaves only; linear
    decoding on a chain: a hand-written chain then decodes linearly); '' = chain. A bank's trees
    carry their own"""


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


class MaskTreeDrafting:
    """Tree drafting for a drafter whose mask tokens propose the next step (gated LoRA, the probe).

    Each step feeds [root, the tree's nodes, a block of D masks after the root and after every
    node the topology gives one]; the block after the deepest accepted node proposes the next
    tree (`candidates`), chosen by the schedule from the path value read off that block. D is the
    depth of the schedule's deepest tree: mask i only sees masks 1..i of its block, so the first D
    are the same as in a longer block and the others would only cost rows. A drafter calls
    `setup_trees` once, `begin_trees` per prompt, and returns `propose_tree` / `observe_tree`."""

    trees: list[Topology] | None = None
    tree_log = None

    def setup_trees(self, options: MaskTreeOptions, method: str) -> None:
        self.tree_options, self.tree_method = options, method
        self.trees, self.schedule, self.bank = None, None, None
        if options.tree:
            self.trees, schedules = load_bank(options.tree, options.task or None, options.blocks)
            self.schedule = tree_schedule(options, schedules, len(self.trees), method)

    def begin_trees(self, masks: torch.Tensor) -> None:
        """Per prompt: `masks` [>= D, d], the embeddings of a block's masks (the first D are used)."""
        block = max(self.trees[i].depth for i in self.schedule.trees)
        if block > masks.shape[0]:
            raise ValueError(f"{self.tree_method} tree {self.tree_options.tree}: a tree of depth {block} needs "
                             f"{block} masks, the drafter has {masks.shape[0]}")
        self.block_masks = masks[:block]
        if self.bank is None or self.bank.k != block:  # compiled once, not per prompt
            self.bank = TopologyBank(self.trees, block)
        self.block = block
        self.position = self.schedule.start()  # index into schedule.trees
        self.ema = None  # a smoothed signal's running average (None until the first observation)
        self.current = None  # the compiled tree of the draft in flight (None: no draft)
        self.tree_tokens: list[int] = []
        if self.tree_options.log and self.tree_log is None:  # line-buffered: one line per step, kept on a crash
            self.tree_log = open(self.tree_options.log, "a", buffering=1)

    def propose_tree(self) -> Draft:
        masks = self.block_masks
        if self.current is None:  # nothing to speculate: the root's mask block alone
            return Draft(tokens=[], parents=[],
                         extra_embeds=masks, extra_parents=list(range(self.block)))
        c = self.current
        return Draft(tokens=list(self.tree_tokens), parents=c.parents,
                     extra_embeds=masks.repeat(len(c.block_rows), 1), extra_parents=c.extra_parents,
                     layout=c.layout, children=c.children)

    def observe_tree(self, step: StepOutput) -> None:
        if self.current is None:  # the root's block: rows right after the root
            rows = list(range(1, 1 + self.block))
        else:
            rows = self.current.block_rows.get(step.last_node)
        used = self.schedule.trees[self.position] if self.current is not None else None
        value = None
        signal = self.schedule.signal if self.schedule.switches else None
        if signal == "ema":  # every step's tokens, whether or not the next step drafts (one host read)
            self.ema = self.schedule.smooth(self.ema, self.top1([0] + step.accepted, step).tolist())
        elif signal == "accept" and used is not None:  # every drafted step's accept length (host data)
            self.ema = self.schedule.smooth(self.ema, [len(step.accepted) + 1])
        if rows is None:  # the deepest accepted node carries no mask block: no speculation next
            self.current, self.tree_tokens = None, []
        else:
            if signal is not None:
                value = self.signal_value(step, rows)
                self.position = self.schedule.next(self.position, value)
            self.current = self.bank.get(self.schedule.trees[self.position])
            self.tree_tokens = self.candidates(step, rows, self.current)
        if self.tree_log is not None:
            self.tree_log.write(json.dumps({"tree": used, "accepted": len(step.accepted), "value": value,
                                            "next": None if self.current is None
                                            else self.schedule.trees[self.position]}) + "\n")

    def signal_value(self, step: StepOutput, rows: list[int]) -> float | None:
        """The schedule's v before choosing the next tree, the block after the last accepted node
        at `rows`: at most one host read (path, path_sum: the chain's factors; entropy: the
        block-start entropy; accept and ema read nothing here)."""
        s = self.schedule
        if s.signal in ("path", "path_sum"):
            return self.path_value(step, rows)
        if s.signal == "entropy":  # the target's distribution at the last accepted node (the bonus's row)
            self.ema = s.smooth(self.ema, entropy(step.logits([step.last_node])).tolist())
        return s.value(self.ema)

    def path_value(self, step: StepOutput, rows: list[int]) -> float:
        """EAGLE-2's path values at this step (`path_signal`): the target's top-1 probability at the
        last accepted node (its bonus token) and the mask head's top-1 probability at every mask of
        the block (the schedule's first `value_depth`), multiplied (path) or the chain's products
        summed over depths (path_sum). Read off logits the verifier computes anyway, in one read."""
        depth = self.schedule.depth_of_value(self.block)
        top1 = self.top1([step.last_node] + rows[:depth], step).tolist()
        return path_signal(self.schedule.signal, top1[0], top1[1:])

    @staticmethod
    def top1(rows: list[int], step: StepOutput) -> torch.Tensor:
        """The top-1 probability of the step's logits at each of `rows`."""
        return torch.softmax(step.logits(rows).float(), -1).amax(-1)

    def candidates(self, step: StepOutput, rows: list[int], compiled: Compiled) -> list[int]:
        """Tokens of every node of `compiled`'s tree from the mask block at `rows` (Medusa-style):
        node (r_1..r_d) = the r_d-th token of mask d's logits, shared by every branch."""
        t = compiled.topology
        top = step.logits(rows[: t.depth]).topk(t.max_rank, dim=-1).indices.tolist()  # [depth, width]
        return [top[d - 1][r] for d, r in zip(t.depths, t.ranks)]
