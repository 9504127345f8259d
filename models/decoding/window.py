"""A step that stays in the target's attention window (EvaByte's EVA): a draft cut at the window end.

EVA attends exactly within a window and through summaries beyond it, and a decoding step never
crosses a window end (`draft_room`: positions left after the root). The decoder passes every
draft through `fit_window` before its forward; on targets without a window it returns at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from mtpkit.models.decoding.drafter import Draft, StepOutput

if TYPE_CHECKING:
    from mtpkit.models.decoding.decoder import Target


def host_ints(values) -> list[int]:
    """A draft's tree shape as host ints (a list or tuple as given; a CPU tensor read)."""
    return list(values) if isinstance(values, (list, tuple)) else values.tolist()


def unchanged(step: StepOutput) -> StepOutput:
    return step


def fit_window(target: Target, draft: Draft, root: int) -> tuple[Draft, Callable[[StepOutput], StepOutput]]:
    """`draft` cut to the nodes (drafts and extras) whose depth fits the room a step whose root sits
    at position `root` has (`draft_room`: on EvaByte its attention window ends there; elsewhere no
    cut): a chain to its first nodes, a tree to its shallow levels, renumbered. Returns the draft
    and `restore`, which gives the drafter the step in its own numbering: a row cut away (never
    accepted) reads as zeros (logits, hidden states) and its argmax as token 0, so a mask block
    past the window drafts nothing useful, and whatever it drafts is verified. MTPC stops its
    drafts at the window end itself (`MTPCDrafter.propose`) and is never cut."""
    room = target.adapter.draft_room(root)
    N, M = draft.num_nodes, draft.num_extras
    if room is None or N + M == 0:
        return draft, unchanged
    parents = [-1] + host_ints(draft.parents) + (host_ints(draft.extra_parents) if M else [])  # step numbering
    depth = [0]
    for p in parents[1:]:
        depth.append(depth[p] + 1)
    if max(depth) <= room:
        return draft, unchanged
    kept = [i for i, d in enumerate(depth) if d <= room]  # parents before children: ancestors kept too
    new = {old: i for i, old in enumerate(kept)}
    drafts, extras = [i - 1 for i in kept if 1 <= i <= N], [i - 1 - N for i in kept if i > N]
    tokens = draft.tokens
    tokens = [tokens[i] for i in drafts] if isinstance(tokens, (list, tuple)) else tokens[drafts]
    cut = Draft(tokens=tokens, parents=[new[parents[i + 1]] for i in drafts],
                draft_probs=None if draft.draft_probs is None else draft.draft_probs[drafts],
                extra_embeds=draft.extra_embeds[extras] if extras else None,
                extra_parents=[new[parents[i + 1 + N]] for i in extras] if extras else None)

    def restore(step: StepOutput) -> StepOutput:
        rows = torch.tensor(kept, device=step.hidden.device)
        hidden = step.hidden.new_zeros((1 + N + M, step.hidden.shape[-1])).index_copy(0, rows, step.hidden)
        shared = step.shared_hidden
        if shared is not None:  # the context's positions before the root, then the step's rows
            before = step.context_len - 1
            shared = torch.cat([shared[:before], shared.new_zeros((1 + N + M, shared.shape[-1]))
                                .index_copy(0, rows, shared[before:])])

        def logits(old_rows: list[int]) -> torch.Tensor:
            inside = [j for j, r in enumerate(old_rows) if r in new]
            got = step.logits([new[old_rows[j]] for j in inside]) if inside else None
            out = torch.zeros(len(old_rows), target.adapter.vocab_size, device=target.device,
                              dtype=torch.float if got is None else got.dtype)
            if inside:
                out[inside] = got
            return out

        choices = None if step.choices is None else [step.choices[new[r]] if r in new else 0
                                                     for r in range(1 + N + M)]
        return StepOutput(accepted=[kept[a] for a in step.accepted], last_node=kept[step.last_node],
                          new_tokens=step.new_tokens, hidden=hidden, logits=logits, context_len=step.context_len,
                          shared_hidden=shared, choices=choices, signal=step.signal)

    return cut, restore
