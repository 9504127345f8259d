"""The gated-LoRA drafter: linear and quadratic decoding (Samragh et al., Sec. 2.4).

Each verifier step feeds [root, speculated tokens..., mask blocks...]; the masks carry the
gated LoRA (the decoder switches the gate on for extra nodes only), so the root and the
speculated tokens are scored by the untouched base model while the masks propose the next
k tokens: one forward both verifies and proposes.

- linear: one block of k masks after the last speculated token. If every speculation is
  accepted its masks give the next k; otherwise the next step has no speculation (Sec. 2.4.1).
- quadratic: a block of k masks after the root and after every speculated token, so whatever
  is accepted, the block after the deepest accepted node gives k fresh speculations
  (Sec. 2.4.2). The paper lists blocks after the k speculated tokens only (k^2 masks); the
  extra block after the root (k(k+1) in all) keeps the "k fresh speculations every step"
  promise when the first speculation is rejected.

Speculations (Sec. 2.3): y_0 = the bonus token; the base head scores mask i with W z_i, the
sampler with W MLP([E(y_{i-1}); z_i]), a chain. Greedy decoding (and `drafts=argmax`) takes each
argmax: deterministic drafts, which speculative sampling treats as one-hot proposals. Under
speculative sampling with `drafts=sample` each y_i is DRAWN from q_i = the head's distribution
under the verifier's own transform (`target_probs`: temperature, then top-p), from the drafter's
seeded generator, and the rows q_i go to the verifier as `draft_probs`: rejection sampling
accepts y_i with min(1, p(y_i) / q_i(y_i)), so a head whose q is close to p gets far more accepted
than a one-hot proposal (acceptance p(y_i)). With the sampler, q_i is conditioned on the drawn
y_{i-1}, its parent in the draft chain. Both modes are exact: the output follows the target's
distribution (tests/eval/test_gated_sampling.py).

Trees (`tree=`): the block after the deepest accepted node proposes a draft TREE of the head's
top-ranked candidates (`mtpkit.models.trees`: rank paths, mask blocks on chosen nodes, a bank of
precompiled trees and a schedule choosing among them by the path value), see `_candidates`.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass

import torch

from mtpkit.models.drafter import Draft, Drafter, StepOutput
from mtpkit.models.gated_lora.head import load_head
from mtpkit.models.gated_lora.inference import to_inference
from mtpkit.models.gated_lora.model import GatedMTP
from mtpkit.models.generate import target_probs
from mtpkit.models.trees import Schedule, TopologyBank, load_bank, mask_blocks

DECODINGS = ("linear", "quadratic")
DRAFTS = ("sample", "argmax")


@dataclass
class GatedLoRADraftConfig:
    head: str = ""
    """head folder (train/export.py output or a checkpoint's head/)"""
    decoding: str = "quadratic"
    """linear | quadratic"""
    sampler: bool = True
    """speculate with the sampler head (if the head has one) instead of the base head"""
    k: int = 0
    """masks per block; 0 = the k the head was trained with. Fewer is exact for the same head
    (mask i only ever sees masks 1..i of its block), so one k=4 head also serves k=2"""
    drafts: str = "sample"
    """sample | argmax: under speculative sampling (temperature > 0), draw each speculation from
    the head's tempered (and top-p) distribution and verify it against that q (sample), or take
    the argmax, verified as a one-hot proposal (argmax). Greedy decoding always takes the argmax"""
    seed: int = 0
    """seed of the drafter's own generator (drafts=sample under speculative sampling only)"""
    tree: str = ""
    """draft a TREE instead of the chain: a bank file written by eval/tree_frontier.py, or chainN
    (N top-1 tokens); '' = the linear / quadratic chain. Tree drafts are the head's top-ranked
    tokens (deterministic, exact under sampling by the verifier's multi-candidate rule)"""
    schedule: str = "static"
    """static | ladder | hyst: which of the bank's trees each step uses (mtpkit.models.trees);
    ladder and hyst read their trees and thresholds from the bank's schedules for `task`"""
    task: str = ""
    """the bank's task whose calibrated schedules to use ('' = the first in the file)"""
    index: int = -1
    """schedule=static: the bank's tree to use (-1 = the task's calibrated static tree, or tree 0)"""
    log: str = ""
    """append one JSON line per verifier step (tree index, nodes, accepted, path value) to this file"""


class GatedLoRADrafter(Drafter):
    name = "gated_lora"

    def __init__(self, config: GatedLoRADraftConfig = GatedLoRADraftConfig(), model: GatedMTP | None = None):
        if config.decoding not in DECODINGS:
            raise ValueError(f"gated_lora decoding must be one of {DECODINGS}, got {config.decoding!r}")
        if config.drafts not in DRAFTS:
            raise ValueError(f"gated_lora drafts must be one of {DRAFTS}, got {config.drafts!r}")
        if model is None and not config.head:
            raise ValueError("gated_lora needs head=DIR (a folder written by train/export.py)")
        self.config = config
        self.model = model
        self.trees, self.schedule, self.bank, self.log = None, None, None, None
        if config.tree:
            self.trees, schedules = load_bank(config.tree, config.task or None)
            self.schedule = tree_schedule(config, schedules, len(self.trees))
        # seeded once, not per prompt: every decode must draw fresh speculations (drafts repeated
        # across runs are not samples from q, and the acceptance rule would be biased)
        self.gen = torch.Generator().manual_seed(config.seed)

    def adapt(self, model, shared: dict):
        """A copy of `model` carrying the gated adapter (one copy per head folder), and its gate."""
        if self.model is None:
            key = ("gated_lora", self.config.head)
            if key not in shared:  # decoding only: the lean gated linears (`to_inference`), on the
                # target's device (the head's own weights, mask embeddings and sampler, load on the CPU)
                device = model.get_input_embeddings().weight.device
                shared[key] = to_inference(load_head(self.config.head, copy.deepcopy(model))).to(device)
            self.model = shared[key]
        if self.config.sampler and self.model.sampler is None:
            raise ValueError(f"gated_lora: sampler=1 but {self.config.head} has no sampler head")
        self.model.eval()
        return self.model.peft.get_base_model(), self.model.gate

    def begin(self, target, prompt_ids: list[int]) -> None:
        trained = self.model.config.k
        if not 0 <= self.config.k <= trained:
            raise ValueError(f"gated_lora k={self.config.k}: the head was trained with k={trained}")
        self.k = self.config.k or trained
        self.masks = self.model.mask_embeds.detach()[: self.k].to(self.model.embed.weight.dtype)
        self.sample = self.sampling and self.config.drafts == "sample"
        if self.sample and self.gen.device != target.device:  # draws run where the head does
            self.gen = torch.Generator(target.device).manual_seed(self.config.seed)
        # the next speculations and, when drawn, the q [len(spec), V] each was drawn from: always
        # set together, so the draft's tokens and its draft_probs rows stay aligned
        self.spec: list[int] = []
        self.spec_probs: torch.Tensor | None = None
        self.blocks: dict[int, list[int]] = {}
        if self.trees is not None:
            # masks per block: the depth of the schedule's deepest tree (mask i only sees masks
            # 1..i, so the first D of a block are exact and the others would only cost rows)
            block = max(self.trees[i].depth for i in self.schedule.trees)
            if block > self.k:
                raise ValueError(f"gated_lora tree {self.config.tree}: a tree of depth {block} is deeper than k={self.k}")
            self.masks = self.masks[:block]
            if self.bank is None or self.bank.k != block:  # compiled once, not per prompt
                self.bank = TopologyBank(self.trees, block)
            self.block = block
            self.position = self.schedule.start()  # index into schedule.trees
            self.current = None  # the compiled tree of the draft in flight (None: no draft)
            if self.config.log and self.log is None:  # line-buffered: one line per step, kept on a crash
                self.log = open(self.config.log, "a", buffering=1)

    def propose(self, tokens: list[int]) -> Draft:
        if self.trees is not None:
            return self._propose_tree()
        N = len(self.spec)
        anchors = list(range(N + 1)) if self.config.decoding == "quadratic" else [N]
        extra_parents, self.blocks = mask_blocks(anchors, N + 1, self.k)
        return Draft(tokens=torch.tensor(self.spec, dtype=torch.long), parents=torch.arange(N),
                     draft_probs=self.spec_probs, extra_embeds=self.masks.repeat(len(anchors), 1),
                     extra_parents=torch.tensor(extra_parents, dtype=torch.long))

    def observe(self, step: StepOutput) -> None:
        if self.trees is not None:
            return self._observe_tree(step)
        rows = self.blocks.get(step.last_node)
        self.spec_probs = None
        if rows is None:  # linear decoding after a partial acceptance: nothing to speculate
            self.spec = []
            return
        if self.sample:
            self.spec, self.spec_probs = self._draw(step, rows)
        elif self.config.sampler:  # y_i = argmax W MLP([E(y_{i-1}); z_i]), chained on the device
            z = step.hidden[rows]  # [k, d]
            prev, spec = torch.tensor(step.new_tokens[-1], device=z.device), []
            for i in range(self.k):
                prev = self.model.sampler_logits(prev, z[i]).argmax()
                spec.append(prev)
            self.spec = torch.stack(spec).tolist()  # one host read for the k speculations
        elif step.choices is not None:  # the verifier read every row's argmax already
            self.spec = [step.choices[r] for r in rows]
        else:
            self.spec = step.logits(rows).argmax(-1).tolist()

    def _draw(self, step: StepOutput, rows: list[int]) -> tuple[list[int], torch.Tensor]:
        """k speculations drawn from the head under the verifier's transform, and the q [k, V]
        each was drawn from (row i given y_0..y_{i-1}: the sampler chains on the drawn tokens)."""
        T, top_p = self.temperature, self.top_p
        if self.config.sampler:  # y_i ~ q_i = target_probs(W MLP([E(y_{i-1}); z_i])), chained
            z = step.hidden[rows]  # [k, d]
            prev, spec, probs = torch.tensor(step.new_tokens[-1], device=z.device), [], []
            for i in range(self.k):
                q = target_probs(self.model.sampler_logits(prev, z[i])[None], T, top_p)[0]  # [V]
                prev = torch.multinomial(q, 1, generator=self.gen)[0]
                spec.append(prev)
                probs.append(q)
            return torch.stack(spec).tolist(), torch.stack(probs)  # one host read for the k draws
        q = target_probs(step.logits(rows), T, top_p)  # [k, V]: q_i = target_probs(W z_i)
        return torch.multinomial(q, 1, generator=self.gen)[:, 0].tolist(), q

    # ---- draft trees (mtpkit.models.trees) ----
    def _propose_tree(self) -> Draft:
        if self.current is None:  # nothing to speculate: the root's mask block alone
            return Draft(tokens=torch.zeros(0, dtype=torch.long), parents=torch.zeros(0, dtype=torch.long),
                         extra_embeds=self.masks, extra_parents=torch.arange(self.block))
        c = self.current
        return Draft(tokens=torch.tensor(self.spec, dtype=torch.long), parents=c.parents,
                     extra_embeds=self.masks.repeat(len(c.block_rows), 1), extra_parents=c.extra_parents,
                     layout=c.layout, children=c.children)

    def _observe_tree(self, step: StepOutput) -> None:
        if self.current is None:  # the root's block: rows right after the root
            rows = list(range(1, 1 + self.block))
        else:
            rows = self.current.block_rows.get(step.last_node)
        used = self.schedule.trees[self.position] if self.current is not None else None
        value = None
        if rows is None:  # the deepest accepted node carries no mask block: no speculation next
            self.current, self.spec = None, []
        else:
            if self.schedule.kind != "static":
                value = self.path_value(step, rows)
                self.position = self.schedule.next(self.position, value)
            self.current = self.bank.get(self.schedule.trees[self.position])
            self.spec = self._candidates(step, rows, self.current)
        if self.log is not None:
            self.log.write(json.dumps({"tree": used, "accepted": len(step.accepted), "value": value,
                                       "next": None if self.current is None else self.schedule.trees[self.position]}) + "\n")

    def path_value(self, step: StepOutput, rows: list[int]) -> float:
        """EAGLE-2's path value at this step: the target's top-1 probability at the last accepted
        node (its bonus token) times the base head's top-1 probability at every mask of the block
        (D = the deepest tree of the schedule). Read off logits the verifier computes anyway."""
        probs = torch.softmax(step.logits([step.last_node] + rows).float(), -1).amax(-1)
        return float(probs.prod())

    def _candidates(self, step: StepOutput, rows: list[int], compiled) -> list[int]:
        """Tokens of every node of `compiled`'s tree from the mask block at `rows`. Base head:
        node (r_1..r_d) = the r_d-th token of mask d's logits (Medusa-style, shared by every
        branch); sampler: the r_d-th token of W MLP([E(parent's token); z_d]), one sampler call
        per depth over that depth's parents (one host read per depth: the next depth's inputs)."""
        t = compiled.topology
        width = t.max_rank
        if not self.config.sampler:
            top = step.logits(rows[: t.depth]).topk(width, dim=-1).indices.tolist()  # [depth, width]
            return [top[d - 1][r] for d, r in zip(t.depths, t.ranks)]
        z = step.hidden[rows]  # [block, d]
        tokens = [0] * t.num_nodes
        node_token = {0: step.new_tokens[-1]}  # the root of the next step: the bonus token
        for d, (nodes, parents) in enumerate(compiled.levels, start=1):
            prev = torch.tensor([node_token[p] for p in parents], device=z.device)
            top = self.model.sampler_logits(prev, z[d - 1].expand(len(parents), -1)).topk(width, dim=-1).indices.tolist()
            where = {par: i for i, par in enumerate(parents)}
            for j in nodes:
                tokens[j - 1] = node_token[j] = top[where[t.parents[j - 1]]][t.ranks[j - 1]]
        return tokens


def tree_schedule(config: GatedLoRADraftConfig, schedules: dict, n_trees: int) -> Schedule:
    """The schedule a drafter config asks for, from the bank's calibrated schedules."""
    if config.schedule == "static":
        if config.index >= 0:
            index = config.index
        elif "static" in schedules:
            index = schedules["static"]["trees"][0]
        else:
            index = 0
        if not 0 <= index < n_trees:
            raise ValueError(f"gated_lora index={index}: the bank {config.tree} has {n_trees} trees")
        return Schedule("static", [index])
    if config.schedule not in schedules:
        raise ValueError(f"gated_lora schedule={config.schedule}: the bank {config.tree} has no calibrated "
                         f"{config.schedule!r} schedule (has {sorted(schedules)}); run eval/tree_frontier.py")
    entry = schedules[config.schedule]  # the bank's entry also holds its simulated tau and tokens/s
    return Schedule(entry["kind"], list(entry["trees"]), list(entry.get("thresholds", [])))
