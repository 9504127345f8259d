"""What a decoding step's rows cost by themselves: the floor a drafter's step is measured against.

A step of a method feeds R rows (root, drafts, masks) to the target; a plain forward of R new
rows on the same target and kernels (the body on a KV cache, then the LM head over every row, no
gate, no drafting, no acceptance) is the least that step can cost. The bench divides each
method's mean decoding-step time by it (`x_rows`): 1.00 would be a loop with no overhead at all.
"""

from __future__ import annotations

import torch

from mtpkit.eval.device_probe import timed
from mtpkit.models.decoding.cache import new_cache
from mtpkit.models.decoding.decoder import Target


@torch.no_grad()
def rows_forward_ms(target: Target, rows: int, cache_len: int, repeats: int = 7) -> float:
    """Median ms of one plain forward of `rows` new positions after `cache_len` cached ones on
    `target` (its body on the decoder's own cache kind, then its LM head on every row)."""
    device = target.device
    generator = torch.Generator().manual_seed(0)
    vocab = target.embed.weight.shape[0]
    past = torch.randint(0, vocab, (1, cache_len), generator=generator).to(device)
    new = torch.randint(0, vocab, (1, rows), generator=generator).to(device)
    cache = new_cache(target.cache, target.config, cache_len + rows)
    target.body(input_ids=past, past_key_values=cache.hf, use_cache=True)
    cache.compact(cache_len, [])
    positions = torch.arange(cache_len, cache_len + rows, device=device)[None]

    def forward():
        hidden = target.body(input_ids=new, position_ids=positions, past_key_values=cache.hf,
                             use_cache=True).last_hidden_state[0]
        target.lm_head(hidden)
        cache.compact(cache_len, [])  # drop the rows again

    forward()  # a second warm-up call beside timed's own
    return 1000 * timed(forward, repeats, device)["median"]
