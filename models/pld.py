"""Prompt lookup decoding (Saxena 2023): draft the continuation of an earlier n-gram match.

The longest n-gram (from `ngram_max` down to `ngram_min`) that ends the sequence and also
occurs earlier in it (prompt or generated text) proposes the `draft_len` tokens that
followed that earlier occurrence, as a chain. The most recent earlier match is used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtpkit.models.decoding.drafter import Draft, Drafter
from mtpkit.models.decoding.step import StepOptions
from mtpkit.models.method import Method


@dataclass
class PLDConfig(StepOptions):
    ngram_max: int = 3
    """longest n-gram to match: longer matches propose drafts more often right"""
    ngram_min: int = 1
    """shortest n-gram to match: 1 drafts after any repeated token; higher drafts only after longer
    matches (fewer wasted rows on text that repeats little)"""
    draft_len: int = 10
    """tokens proposed after a match: more where replies copy long spans of the prompt (code edits,
    summaries)"""


def lookup(tokens: torch.Tensor, ngram_max: int, ngram_min: int, draft_len: int) -> list[int]:
    """tokens [T] -> the draft (possibly empty) following the latest earlier n-gram match."""
    T = tokens.numel()
    for n in range(min(ngram_max, T - 1), ngram_min - 1, -1):
        windows = tokens.unfold(0, n, 1)[: T - n]  # [T-n, n]: every n-gram that is not the suffix
        hits = (windows == tokens[T - n:]).all(-1).nonzero().flatten()
        if hits.numel():
            start = int(hits[-1]) + n
            return tokens[start: start + draft_len].tolist()
    return []


class PLDDrafter(Drafter):
    name = "pld"

    def __init__(self, config: PLDConfig = PLDConfig()):
        if not 1 <= config.ngram_min <= config.ngram_max or config.draft_len < 1:
            raise ValueError(f"pld needs 1 <= ngram_min <= ngram_max and draft_len >= 1, got {config}")
        self.config = config

    def propose(self, tokens: list[int]) -> Draft:
        c = self.config
        return Draft.chain(lookup(torch.tensor(tokens), c.ngram_max, c.ngram_min, c.draft_len))


METHOD = Method(name="pld", summary="prompt lookup decoding: draft what followed the latest earlier n-gram match",
                options=PLDConfig, drafter=PLDDrafter)
