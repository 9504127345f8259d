"""Mask-token training inputs ("Your LLM Knows the Future", Samragh et al., arXiv:2507.11851,
Sec. 2.1 and Figure 4).

A sequence of n tokens with next-token labels becomes n NTP slots plus, after every token
that carries a loss, a block of k mask slots:

    x0 x1 [m1 m2] x2 [m1 m2] x3 ...       (k = 2; no masks after prompt tokens)

- NTP slot t: position id t, label labels[t] (= x[t+1] or IGNORE); attends to NTP slots <= t
  only, so next-token outputs are those of the unmasked sequence.
- Mask i of the block anchored at t: position id t + i, label labels[t + i] (= x[t+1+i]);
  attends to NTP slots <= t and to masks 1..i of its own block, never to other blocks.

One call simulates n prompts "first t tokens + k masks" in a single forward. Everything is
built with tensor ops (no Python loop over tokens); `collate_mask_inputs` pads a batch and
builds the 4D additive attention mask.

Cheaper training (both exact for the losses they keep):
- `choose_anchors`: mask blocks after a random subset of the loss-carrying positions only, so a
  sequence grows by k x anchors rather than k x length (`mask_inputs(..., anchors=)`).
- `collate_cached`: the same slots split in two forwards. The NTP slots never see a mask and
  carry no adapter (the gate is off there), so the frozen backbone runs them once without
  gradient and keeps its keys/values; the mask slots then run with gradient, attending to that
  cache and to their own block. Backward then covers the mask slots only.
"""

from __future__ import annotations

import torch

from mtpkit.data.chat import IGNORE


def choose_anchors(token_labels: torch.Tensor, fraction: float, generator: torch.Generator) -> torch.Tensor | None:
    """[n] bool: round(fraction x A) of the A loss-carrying positions (at least one), drawn
    uniformly without replacement, to get mask blocks; None (all of them) at fraction >= 1."""
    if fraction >= 1:
        return None
    labels = torch.cat([token_labels[1:], token_labels.new_full((1,), IGNORE)])
    candidates = (labels != IGNORE).nonzero().squeeze(1)
    keep = max(1, round(fraction * len(candidates))) if len(candidates) else 0
    chosen = torch.zeros(len(token_labels), dtype=torch.bool)
    chosen[candidates[torch.randperm(len(candidates), generator=generator)[:keep]]] = True
    return chosen


def mask_inputs(input_ids: torch.Tensor, token_labels: torch.Tensor, k: int,
                anchors: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Figure-4 slots of one sequence. input_ids, token_labels: [n], the labels in the Hugging Face
    convention of `tokenize_chat` (token_labels[t] = x[t] where x[t] is a token to learn, else
    IGNORE; the model predicts x[t+1] at position t). Returns [T] tensors with labels SHIFTED
    (the target of each slot), T = n + k * (number of loss-carrying positions):

    input_ids (0 at masks), mask_index (0 = NTP, i = mask i), position_ids, labels, anchor (the
    position a slot sees up to: t for NTP t and for the masks anchored at t), prev_ids (the
    token before each label, x[position], the sampler's y_prev) and ntp_slot (the slot of the
    NTP token at the same position: the latent-consistency anchor).

    anchors: [n] bool (`choose_anchors`), the positions that get a mask block; the others keep
    their NTP slot (the masks' context and consistency targets) without a label. None = every
    loss-carrying position, the paper's layout.
    """
    n = input_ids.numel()
    targets = torch.cat([token_labels[1:], token_labels.new_full((1,), IGNORE)])  # targets[t]: token after t
    labels = targets if anchors is None else targets.masked_fill(~anchors, IGNORE)  # NTP labels, anchors only
    has_masks = labels != IGNORE                                     # [n]
    before = torch.cumsum(has_masks.long(), 0) - has_masks.long()    # anchors strictly before t
    ntp_slot = torch.arange(n) + k * before                          # [n] slot of NTP token t
    T = n + k * int(has_masks.sum())
    starts = has_masks.nonzero().squeeze(1)                          # [A] the anchors
    i = torch.arange(1, k + 1)
    mask_slots = (ntp_slot[starts][:, None] + i).reshape(-1)         # [A*k]
    mask_pos = (starts[:, None] + i).reshape(-1)                     # t + i

    out = {
        "input_ids": torch.zeros(T, dtype=torch.long),
        "mask_index": torch.zeros(T, dtype=torch.long),
        "position_ids": torch.zeros(T, dtype=torch.long),
        "labels": torch.full((T,), IGNORE, dtype=torch.long),
        "anchor": torch.zeros(T, dtype=torch.long),
    }
    out["input_ids"][ntp_slot] = input_ids
    out["position_ids"][ntp_slot] = torch.arange(n)
    out["labels"][ntp_slot] = labels
    out["anchor"][ntp_slot] = torch.arange(n)
    out["mask_index"][mask_slots] = i.repeat(len(starts))
    out["position_ids"][mask_slots] = mask_pos
    inside = mask_pos < n
    mask_labels = torch.full_like(mask_pos, IGNORE)
    mask_labels[inside] = targets[mask_pos[inside]]
    out["labels"][mask_slots] = mask_labels
    out["anchor"][mask_slots] = starts.repeat_interleave(k)
    pos = out["position_ids"].clamp(max=n - 1)
    out["prev_ids"] = input_ids[pos]
    out["ntp_slot"] = ntp_slot[pos]
    return out


def allowed_attention(slots: dict[str, torch.Tensor]) -> torch.Tensor:
    """[T, T] bool, query row may attend to key column (the Figure-4 rules)."""
    is_mask = slots["mask_index"] > 0
    anchor, idx = slots["anchor"], slots["mask_index"]
    q_anchor, k_pos = anchor[:, None], slots["position_ids"][None, :]
    sees_ntp = ~is_mask[None, :] & (k_pos <= q_anchor)
    same_block = (is_mask[:, None] & is_mask[None, :] & (anchor[None, :] == q_anchor)
                  & (idx[None, :] <= idx[:, None]))
    return sees_ntp | same_block


def collate_mask_inputs(features: list[dict[str, torch.Tensor]], dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Right-pad slot dicts from `mask_inputs` into a batch with a 4D additive mask [B, 1, T, T].
    Padding slots attend only to themselves (no all-masked rows) and carry no label."""
    T = max(f["input_ids"].numel() for f in features)
    B = len(features)
    batch = {key: torch.zeros(B, T, dtype=torch.long) for key in ("input_ids", "mask_index", "position_ids",
                                                                 "prev_ids", "ntp_slot")}
    batch["labels"] = torch.full((B, T), IGNORE, dtype=torch.long)
    allowed = torch.eye(T, dtype=torch.bool).repeat(B, 1, 1)
    for b, f in enumerate(features):
        n = f["input_ids"].numel()
        for key in batch:
            batch[key][b, :n] = f[key]
        allowed[b, :n, :n] = allowed_attention(f)
    batch["attention_mask"] = _additive(allowed, dtype)
    return batch


def collate_cached(features: list[dict[str, torch.Tensor]], dtype=torch.float32) -> dict[str, torch.Tensor]:
    """The slots of `mask_inputs` as two forwards (see the module docstring), right-padded:

    ntp_ids, ntp_labels [B, n] and ntp_attention_mask (None when no row is padded: the model's
    causal mask; else [B, 1, n, n]) for the first, gradient-free forward; mask_index,
    position_ids, labels, prev_ids [B, M] and attention_mask [B, 1, M, n + M] (keys: the n cached
    NTP positions, then the mask slots) for the second; lcm_pos [B, M], the position of each
    mask's consistency anchor (the NTP token predicting the same label)."""
    B = len(features)
    ntp = [f["mask_index"] == 0 for f in features]
    n = max(int(m.sum()) for m in ntp)
    M = max(int((~m).sum()) for m in ntp)
    batch = {"ntp_ids": torch.zeros(B, n, dtype=torch.long), "ntp_labels": torch.full((B, n), IGNORE, dtype=torch.long)}
    for key in ("mask_index", "position_ids", "prev_ids", "lcm_pos"):
        batch[key] = torch.zeros(B, M, dtype=torch.long)
    batch["labels"] = torch.full((B, M), IGNORE, dtype=torch.long)
    ntp_allowed = torch.eye(n, dtype=torch.bool).repeat(B, 1, 1)
    allowed = torch.zeros(B, M, n + M, dtype=torch.bool)
    allowed[:, :, n:] = torch.eye(M, dtype=torch.bool)  # padding rows see themselves only
    padded = False
    for b, (f, is_ntp) in enumerate(zip(features, ntp)):
        rows = (~is_ntp).nonzero().squeeze(1)
        nb, mb = int(is_ntp.sum()), len(rows)
        padded |= nb < n
        batch["ntp_ids"][b, :nb] = f["input_ids"][is_ntp]
        batch["ntp_labels"][b, :nb] = f["labels"][is_ntp]
        for key in ("mask_index", "position_ids", "prev_ids", "labels"):
            batch[key][b, :mb] = f[key][rows]
        batch["lcm_pos"][b, :mb] = f["position_ids"][rows].clamp(max=nb - 1)
        full = allowed_attention(f)  # NTP slots appear in position order
        ntp_allowed[b, :nb, :nb] = full[is_ntp][:, is_ntp]
        allowed[b, :mb, :nb] = full[rows][:, is_ntp]
        allowed[b, :mb, n:n + mb] = full[rows][:, rows]
    batch["ntp_attention_mask"] = _additive(ntp_allowed, dtype) if padded else None
    batch["attention_mask"] = _additive(allowed, dtype)
    return batch


def _additive(allowed: torch.Tensor, dtype) -> torch.Tensor:
    """[B, Q, K] bool -> [B, 1, Q, K] additive mask (0 where allowed, dtype's min elsewhere)."""
    mask = torch.zeros(allowed.shape[0], 1, *allowed.shape[1:], dtype=dtype)
    return mask.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)
