"""The drafter interface shared by every speculative method.

A drafter proposes; the verifier (`mtpkit.models.decoding.decoder`) runs the target, accepts and owns the
KV cache. Each step the verifier feeds ONE target forward over

    [root (last accepted token), draft nodes..., extra nodes...]

where draft nodes form a tree under the root (`Draft.parents`) and extra nodes are inputs the
drafter asks for (mask tokens) as embeddings attached anywhere in that tree. After acceptance
the drafter reads back the outputs it needs (`StepOutput`) and prepares its next proposal:
this is how mask-token methods verify and generate in the same forward.

Node indexing inside a step: 0 is the root, 1..N the draft nodes, N+1..N+M the extra nodes;
every parent index is smaller than its child's.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class Draft:
    """A draft tree for one verifier step.

    tokens:        [N] draft tokens: host ints (a list: the decoder uploads them, without blocking)
                   or a tensor on the target's device (a drafter's argmax stays there: the decoder
                   reads it with its acceptance decision).
    parents:       [N] parent of each draft node (0 = root, j = draft node j): host ints (the
                   tree's shape is host data: the decoder reads it without touching a tensor).
    draft_probs:   [N, V] the drafter's distribution each token was drawn from, given its
                   parent's path; None means the tokens were chosen deterministically
                   (top-k, n-gram match), which speculative sampling treats as one-hot.
    extra_embeds:  [M, d] input embeddings of extra nodes (e.g. mask tokens), or None.
    extra_parents: [M] parent of each extra node, indexing the whole step (root, drafts, extras);
                   host ints, as `parents`.
    layout:        the step's tree attention layout precompiled (`mtpkit.models.trees.tree_layout`
                   of [-1, parents..., extra_parents...]: a `TopologyBank` tree), used when the
                   step's context is the root alone; None: the decoder builds (and caches) it.
    children:      children of every step node 0..N (root and drafts), precompiled likewise.
    """
    tokens: list[int] | torch.Tensor
    parents: list[int] | tuple[int, ...]
    draft_probs: torch.Tensor | None = None
    extra_embeds: torch.Tensor | None = None
    extra_parents: list[int] | tuple[int, ...] | None = None
    layout: tuple[torch.Tensor, torch.Tensor] | None = None
    children: list[list[int]] | None = None

    @staticmethod
    def empty() -> "Draft":
        return Draft(tokens=[], parents=[])

    @staticmethod
    def chain(tokens: list[int]) -> "Draft":
        """A linear draft: each token the child of the previous one."""
        return Draft(tokens=list(tokens), parents=list(range(len(tokens))))

    @property
    def num_nodes(self) -> int:
        return len(self.tokens)

    @property
    def num_extras(self) -> int:
        return 0 if self.extra_embeds is None else int(self.extra_embeds.shape[0])


@dataclass
class StepOutput:
    """What the verifier tells the drafter after a step.

    accepted:   step indices of the accepted draft nodes, root excluded, in path order.
    last_node:  step index of the deepest accepted node (0 if nothing was accepted).
    new_tokens: the tokens this step added (accepted draft tokens, then the bonus token).
    hidden:     [Q, d] last-layer hidden states of every node of the step.
    logits:     `logits(rows) -> [len(rows), V]` target logits of the given step rows
                (computed lazily: only the rows asked for pay for the LM head).
    context_len: positions of the forward before the draft nodes (the root is the last of them;
                the whole prompt at the first step).
    shared_hidden: [context_len + Q - 1, d] hidden states after layer `Drafter.shared_layer` for
                every position of the forward (None unless the drafter asks for them).
    choices:    [Q] the target's argmax token of every step row, already on the host (greedy
                decoding on the device path reads them with the acceptance decision), or None:
                then `logits(rows).argmax(-1)` gives them.
    signal:     what the drafter's `step_signal` returned, on the host: read with the acceptance
                decision, or None where the decoder did not ask for it (the CPU path, a step whose
                acceptance is walked on the host) or the drafter wanted nothing.
    """
    accepted: list[int]
    last_node: int
    new_tokens: list[int]
    hidden: torch.Tensor
    logits: Callable[[list[int]], torch.Tensor]
    context_len: int = 1
    shared_hidden: torch.Tensor | None = None
    choices: list[int] | None = None
    signal: list[float] | None = None


class Drafter:
    """Base drafter: proposes nothing, which makes the verifier plain autoregressive decoding."""

    name = "ar"
    shared_layer: int | None = None
    """index into the body's hidden_states to return as `StepOutput.shared_hidden` (MTPC's
    shared/draft split: the state after the last shared layer), or None"""
    sampling: bool = False
    """set by the decoder before `begin`: True when drafts are verified by speculative sampling
    (a drafter that can sample its drafts then returns them with `draft_probs`)"""
    temperature: float = 0.0
    """set by the decoder with `sampling`: the temperature the verifier applies to the target's
    logits (a drafter that samples draws from its own logits under the same transform)"""
    top_p: float = 1.0
    """set by the decoder with `sampling`: the nucleus the verifier keeps of the target's
    distribution (1.0 = all of it)"""
    wants_signal: bool = False
    """whether the decoder calls `step_signal` (no device work for the drafters that set none)"""

    def adapt(self, model, shared: dict):
        """(model, gate) this drafter decodes with, given the plain target `model`. Drafters that
        change the target (gated LoRA) return an adapted copy and its gate; `shared` is a dict the
        caller keeps across drafters so weights several of them use are loaded once."""
        return model, None

    def drop_bonus(self, accepted: int, proposed: int) -> bool:
        """Whether the verifier discards this step's bonus token, the newest kept token then being
        the next root (fed again, so its state comes with the next forward). Standard speculative
        decoding always keeps it; MTPC's Algorithm 2 drops it when the drafter needs
        the state of the newest token (see `MTPCDrafter.drop_bonus`). Dropping is exact only where
        the bonus was drawn from the plain target distribution, never a rejection residual."""
        return False

    def begin(self, target, prompt_ids: list[int]) -> None:
        """Reset per-prompt state. `target` is the `mtpkit.models.decoding.decoder.Target` being decoded."""

    def propose(self, tokens: list[int]) -> Draft:
        """Draft for the next step; `tokens` is the whole sequence so far, root last."""
        return Draft.empty()

    def observe(self, step: StepOutput) -> None:
        """Read the outputs of the step just verified."""

    def redo_draft(self) -> None:
        """The model work of the last draft done again, nothing kept (no state, no draw changes):
        the bench runs it before each floor forward, so the floor meets the caches a step's forward
        meets after its draft (a head larger than the backbone evicts the backbone's weights). Nothing
        by default: a drafter whose draft is no model work of its own, or runs inside the target's
        forward (gated LoRA's mask rows: `RowsFloor.own` gates them)."""

    def step_signal(self, hidden: torch.Tensor, logits: torch.Tensor, bonus: torch.Tensor) -> torch.Tensor | None:
        """Numbers [F] the drafter wants on the host after this step, computed on the device from
        the deepest accepted node's row before the decoder's one read of the acceptance decision,
        and read with it (`StepOutput.signal`): the row's last-layer state `hidden` [1, d], the
        target's `logits` [1, V] there and the `bonus` token [1]. The decoder asks a drafter that
        `wants_signal` where it knows that node on the device (the device path); None: nothing."""
        return None


class StockAR(Drafter):
    """AR on an unpacked copy of the target (torch's own kernels): the reference that shows
    whether packed kernels (`mtpkit.models.packed_linear`) made plain decoding faster or slower."""

    name = "ar_stock"

    def adapt(self, model, shared: dict):
        if "ar_stock" not in shared:
            shared["ar_stock"] = copy.deepcopy(model)
        return shared["ar_stock"], None
