"""Packed byte sequences for MTPC training, the layout of "Fast and Expressive Multi-Byte
Prediction with Probabilistic Circuits" (arXiv:2511.11346, Sec. 4.1): examples longer than a
sequence are dropped (the paper limits the context to 8,192 bytes and filters out the longer
examples), the rest are concatenated whole into sequences of at most `seq_len` positions.

Examples stay apart in two ways:
- attention: `segments` [T] numbers the examples of a sequence (0, 1, ...; -1 = padding), and
  the model encodes each segment on its own from position 0 (`MTPCModel.features(...,
  segments=)`), so no position attends to another example (exact on any attention, EVA included);
- loss: `window_targets_packed` marks a window byte invalid when it belongs to another example
  than the window's position, so no window predicts across an example's end.
"""

from __future__ import annotations

import torch

from mtpkit.data.chat import IGNORE
from mtpkit.models.mtpc.model import segment_spans  # noqa: F401  (re-exported: the spans of a packed row)


def pack_examples(features: list[dict], seq_len: int, seed: int = 0) -> tuple[list[dict], int]:
    """Shuffle (seeded) and pack whole examples, next-fit, into sequences of at most `seq_len`.

    features: {"input_ids", "labels"} 1D tensors of one example each (labels next-byte aligned).
    Returns (sequences with "input_ids", "labels", "segments", number of examples dropped as
    longer than `seq_len`)."""
    kept = [f for f in features if len(f["input_ids"]) <= seq_len]
    order = torch.randperm(len(kept), generator=torch.Generator().manual_seed(seed)).tolist()
    sequences, current = [], []

    def close():
        sequences.append({
            "input_ids": torch.cat([f["input_ids"] for f in current]),
            "labels": torch.cat([f["labels"] for f in current]),
            "segments": torch.cat([torch.full((len(f["input_ids"]),), s, dtype=torch.long)
                                   for s, f in enumerate(current)]),
        })

    used = 0
    for i in order:
        f = kept[i]
        if current and used + len(f["input_ids"]) > seq_len:
            close()
            current, used = [], 0
        current.append(f)
        used += len(f["input_ids"])
    if current:
        close()
    return sequences, len(features) - len(kept)


def pad_packed(feats: list[dict], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad packed sequences: ids, labels (IGNORE on padding), segments (-1 on padding) [B, T]."""
    T = max(len(f["input_ids"]) for f in feats)
    ids = torch.full((len(feats), T), pad_id, dtype=torch.long)
    labels = torch.full((len(feats), T), IGNORE, dtype=torch.long)
    segments = torch.full((len(feats), T), -1, dtype=torch.long)
    for b, f in enumerate(feats):
        n = len(f["input_ids"])
        ids[b, :n], labels[b, :n], segments[b, :n] = f["input_ids"], f["labels"], f["segments"]
    return ids, labels, segments


def window_targets_packed(labels: torch.Tensor, segments: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`window_targets` of a packed batch: targets [B, T, n] and valid [B, T, n], where byte j of the
    window at t is valid only if it is an assistant byte of the same example as position t."""
    B, T = labels.shape
    padded = torch.cat([labels, labels.new_full((B, n - 1), IGNORE)], 1).unfold(1, n, 1)  # [B, T, n]
    seg = torch.cat([segments, segments.new_full((B, n - 1), -1)], 1).unfold(1, n, 1)  # [B, T, n]
    valid = (padded != IGNORE) & (seg == segments[..., None]) & (segments[..., None] >= 0)
    return padded.clamp_min(0), valid
