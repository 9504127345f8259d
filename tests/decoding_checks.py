"""Shared checks of decoding tests: decode prompts, require AR's outputs, count what was drafted."""

from __future__ import annotations

from mtpkit.models.decoding.decoder import decode


def decode_equal_to_ar(target, drafter, prompts, wants, max_new_tokens: int = 20, depths: int = 2):
    """Decode every prompt with `drafter`, assert each output is `wants`' (AR's); returns (target
    calls, accepted drafts at depths 1..`depths`) over all prompts."""
    calls, accepted = 0, [0] * depths
    for prompt, want in zip(prompts, wants):
        got = decode(target, drafter, prompt, max_new_tokens)
        assert got.tokens == want
        calls += got.target_calls
        for d, count in enumerate(got.accept_counts[:depths]):
            accepted[d] += count
    return calls, accepted
