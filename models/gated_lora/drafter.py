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
precompiled trees and a schedule choosing among them by the path value), see `candidates`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from mtpkit.models.decoding.drafter import Draft, Drafter, StepOutput
from mtpkit.models.gated_lora.head import load_head, read_settings
from mtpkit.models.gated_lora.inference import to_inference
from mtpkit.models.gated_lora.model import GatedMTP
from mtpkit.models.screen import ScreenedHead
from mtpkit.models.generate import target_probs
from mtpkit.models.head_folder import recorded_backbone
from mtpkit.models.trees import MaskTreeDrafting, MaskTreeOptions, check_ranks, mask_blocks

DECODINGS = ("linear", "quadratic")
DRAFTS = ("sample", "argmax")


@dataclass
class GatedLoRADraftConfig(MaskTreeOptions):
    head: str = ""
    """head folder (train/export.py output or a checkpoint's head/)"""
    decoding: str = "quadratic"
    """linear | quadratic (Sec. 2.4): quadratic puts a mask block after every speculated token, so
    a step drafts again after a partial acceptance, at more rows per step; linear where a step's
    rows are dear"""
    sampler: int = -1
    """which head speculates: 1 the sampler head (refused by name on a head trained with
    --sampler 0, which has none), 0 the base head, -1 (auto) the sampler when the head has one,
    else the base head. 0 where the sampler's sequential calls cost more than they gain"""
    k: int = 0
    """masks per block; 0 = the k the head was trained with. Fewer is exact for the same head
    (mask i only ever sees masks 1..i of its block), so one k=4 head also serves k=2: fewer where
    the deep speculations are rarely accepted"""
    drafts: str = "sample"
    """sample | argmax: under speculative sampling (temperature > 0), draw each speculation from
    the head's tempered (and top-p) distribution and verify it against that q (sample), or take
    the argmax, verified as a one-hot proposal (argmax). Greedy decoding always takes the argmax.
    sample accepts more where the head's q is close to the target's p"""
    seed: int = 0
    """seed of the drafter's own generator (drafts=sample under speculative sampling only):
    another seed, another draw"""
    allow_other_backbone: bool = False
    """run the head on a backbone other than the one it was trained on (refused otherwise; the
    bench marks the row), e.g. to see how a head transfers to a fine-tune of its backbone"""
    # tree, schedule, task, index, log, blocks: `MaskTreeOptions` (draft trees, mtpkit.models.trees)


class GatedLoRADrafter(MaskTreeDrafting, Drafter):
    name = "gated_lora"

    def __init__(self, config: GatedLoRADraftConfig = GatedLoRADraftConfig(), model: GatedMTP | None = None):
        if config.decoding not in DECODINGS:
            raise ValueError(f"gated_lora decoding must be one of {DECODINGS}, got {config.decoding!r}")
        if config.drafts not in DRAFTS:
            raise ValueError(f"gated_lora drafts must be one of {DRAFTS}, got {config.drafts!r}")
        if model is None and not config.head:
            raise ValueError("gated_lora needs head=DIR (a folder written by train/export.py)")
        if config.sampler not in (-1, 0, 1):
            raise ValueError(f"gated_lora sampler must be -1 (auto), 0 or 1, got {config.sampler!r}")
        if config.k < 0:
            raise ValueError(f"gated_lora k={config.k}: masks per block, k >= 0 (0 = the head's k)")
        self.config = config
        self.model = model
        self.setup_trees(config, "gated_lora")
        if model is not None:
            self._check_model()
        else:  # the head's settings checked now, before any model loads
            head_config, lora = read_settings(config.head)
            self._check_head(lora.k, lora.sampler, recorded_backbone(head_config).get("vocab_size"))
        # seeded once, not per prompt: every decode must draw fresh speculations (drafts repeated
        # across runs are not samples from q, and the acceptance rule would be biased)
        self.gen = torch.Generator().manual_seed(config.seed)
        # the sampler's bf16 LM-head screen (`sampler_top`): made at the first `begin` on a CPU, kept
        self.screen = self.screens = None

    @property
    def few_shapes(self) -> bool:
        """Linear and quadratic chains, or one static tree: a step shape or two, each compiled once
        (`mtpkit.models.decoding.step_plan`)."""
        return self.trees is None or len(set(self.schedule.trees)) == 1

    def adapt(self, model, shared: dict):
        """A copy of `model` carrying the gated adapter (one copy per head folder), and its gate."""
        if self.model is None:
            key = ("gated_lora", self.config.head)
            if key not in shared:  # decoding only: the lean gated linears (`to_inference`), on the
                # target's device (the head's own weights, mask embeddings and sampler, load on the CPU)
                device = model.get_input_embeddings().weight.device
                head = load_head(self.config.head, copy.deepcopy(model),
                                 allow_other_backbone=self.config.allow_other_backbone)
                shared[key] = to_inference(head).to(device)
            self.model = shared[key]
        self._check_model()
        self.model.eval()
        return self.model.peft.get_base_model(), self.model.gate

    def _check_model(self) -> None:
        """`_check_head` against the loaded head and its backbone's vocabulary."""
        self._check_head(self.model.config.k, self.model.sampler is not None,
                         self.model.peft.get_base_model().get_output_embeddings().weight.shape[0])

    def _check_head(self, trained_k: int, has_sampler: bool, vocab_size: int | None) -> None:
        """The options against a head trained with `trained_k` masks, with or without a sampler, on
        a vocabulary of `vocab_size` (None: unknown)."""
        if self.config.k > trained_k:
            raise ValueError(f"gated_lora k={self.config.k}: the head was trained with k={trained_k} (k <= {trained_k})")
        if self.config.sampler == 1 and not has_sampler:
            raise ValueError(f"gated_lora: sampler=1 but {self.config.head or 'the head'} has no sampler head "
                             "(trained with --sampler 0): use sampler=0 or leave sampler unset")
        if self.trees is not None and isinstance(vocab_size, int):
            check_ranks(self.trees, vocab_size, f"gated_lora tree={self.config.tree!r}")

    @property
    def use_sampler(self) -> bool:
        """The head that speculates: the sampler (chained on the drafted tokens) or the base head."""
        return self.model.sampler is not None if self.config.sampler == -1 else bool(self.config.sampler)

    def begin(self, target, prompt_ids: list[int]) -> None:
        self.k = self.config.k or self.model.config.k  # 0 <= k <= the head's: checked when built (_check_head)
        self.masks = self.model.mask_embeds.detach()[: self.k].to(self.model.embed.weight.dtype)
        self.sample = self.sampling and self.config.drafts == "sample"
        if self.sample and self.gen.device != target.device:  # draws run where the head does
            self.gen = torch.Generator(target.device).manual_seed(self.config.seed)
        # the next speculations and, when drawn, the q [len(spec), V] each was drawn from: always
        # set together, so the draft's tokens and its draft_probs rows stay aligned
        self.spec: list[int] = []
        self.spec_probs: torch.Tensor | None = None
        self.blocks: dict[int, list[int]] = {}
        # the sampler's top tokens from a bf16 screen of the LM head (exact: `ScreenedHead`) on a CPU
        if getattr(target, "cpu_paths", True) and self.use_sampler:
            self.screens = ScreenedHead.of(self.model.lm_head, self.screens)
            self.screen = self.screens
        else:
            self.screen = None
        if self.trees is not None:
            self.begin_trees(self.masks)

    def propose(self, tokens: list[int]) -> Draft:
        if self.trees is not None:
            return self.propose_tree()
        N = len(self.spec)
        anchors = list(range(N + 1)) if self.config.decoding == "quadratic" else [N]
        extra_parents, self.blocks = mask_blocks(anchors, N + 1, self.k)
        return Draft(tokens=list(self.spec), parents=list(range(N)),
                     draft_probs=self.spec_probs, extra_embeds=self.masks.repeat(len(anchors), 1),
                     extra_parents=extra_parents)

    def observe(self, step: StepOutput) -> None:
        if self.trees is not None:
            return self.observe_tree(step)
        rows = self.blocks.get(step.last_node)
        self.spec_probs = None
        if rows is None:  # linear decoding after a partial acceptance: nothing to speculate
            self.spec = []
            return
        if self.sample:
            self.spec, self.spec_probs = self._draw(step, rows)
        elif self.use_sampler:  # y_i = argmax W MLP([E(y_{i-1}); z_i]), chained on the device
            z = step.hidden[rows]  # [k, d]
            prev, spec = torch.tensor(step.new_tokens[-1], device=z.device), []
            for i in range(self.k):
                prev = self.sampler_top(prev, z[i], 1)[0]
                spec.append(prev)
            self.spec = torch.stack(spec).tolist()  # one host read for the k speculations
        elif step.choices is not None:  # the verifier read every row's argmax already
            self.spec = [step.choices[r] for r in rows]
        else:
            self.spec = step.logits(rows).argmax(-1).tolist()

    def sampler_top(self, prev: torch.Tensor, z: torch.Tensor, k: int) -> torch.Tensor:
        """The k best tokens [..., k] of the sampler's logits W MLP([E(prev); z]), best first: on a
        CPU from the bf16 screen of the LM head (`ScreenedHead`: the float32 ranking read at half the
        bytes), else from the logits themselves."""
        if self.screen is not None:
            return self.screen.topk(self.model.sampler(self.model.embed(prev), z), k)
        logits = self.model.sampler_logits(prev, z)
        return logits.argmax(-1, keepdim=True) if k == 1 else logits.topk(k, dim=-1).indices

    def _draw(self, step: StepOutput, rows: list[int]) -> tuple[list[int], torch.Tensor]:
        """k speculations drawn from the head under the verifier's transform, and the q [k, V]
        each was drawn from (row i given y_0..y_{i-1}: the sampler chains on the drawn tokens)."""
        T, top_p = self.temperature, self.top_p
        if self.use_sampler:  # y_i ~ q_i = target_probs(W MLP([E(y_{i-1}); z_i])), chained
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

    def candidates(self, step: StepOutput, rows: list[int], compiled) -> list[int]:
        """Tokens of every node of `compiled`'s tree from the mask block at `rows`. Base head:
        `MaskTreeDrafting.candidates` (the r_d-th token of mask d's logits); sampler: the r_d-th
        token of W MLP([E(parent's token); z_d]), one sampler call per depth over that depth's
        parents (one host read per depth: the next depth's inputs)."""
        if not self.use_sampler:
            return super().candidates(step, rows, compiled)
        t = compiled.topology
        width = t.max_rank
        z = step.hidden[rows]  # [block, d]
        tokens = [0] * t.num_nodes
        node_token = {0: step.new_tokens[-1]}  # the root of the next step: the bonus token
        for d, (nodes, parents) in enumerate(compiled.levels, start=1):
            prev = torch.tensor([node_token[p] for p in parents], device=z.device)
            top = self.sampler_top(prev, z[d - 1].expand(len(parents), -1), width).tolist()
            where = {par: i for i, par in enumerate(parents)}
            for j in nodes:
                tokens[j - 1] = node_token[j] = top[where[t.parents[j - 1]]][t.ranks[j - 1]]
        return tokens

