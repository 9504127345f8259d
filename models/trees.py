"""Draft-tree topologies and a precompiled bank of them.

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
switching trees between steps is choosing an index; the run-time policies that choose it
are `mtpkit.models.schedules`.
"""

from __future__ import annotations

import json
from functools import lru_cache
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mtpkit.models.decoding.drafter import Draft, StepOutput
from mtpkit.models.decoding.step import StepOptions
from mtpkit.models.schedules import Schedule, entropy, path_signal, tree_schedule


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
    """static | ladder | hyst: which of the bank's trees each step uses (mtpkit.models.schedules);
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
