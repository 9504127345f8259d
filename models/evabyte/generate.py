"""EvaByte's own autoregressive decoding: the loop its `generate()` ran under transformers 4.47,
written out. EvaByte's code (github.com/OpenEvaByte/evabyte `evabyte_hf/`) has no
`GenerationMixin` under transformers 5.x, and 5.x's `generate` would hand its forward a
`DynamicCache`, which EVA attention cannot take. Its forward makes its own cache when given none
(`EvaCache` in plain PyTorch; with Triton on a GPU, `EvaStaticCacheForTriton`): the prompt is
prefilled, then one byte a forward at an explicit position. This is the plain decoding an
EvaByte user has, the baseline the bench's `hf_ar` runs on EvaByte."""

from __future__ import annotations

import torch

from mtpkit.models.generate import sample_next


@torch.no_grad()
def evabyte_generate(model, prompt_ids: list[int], max_new_tokens: int, eos_token_ids=(), temperature: float = 0.0,
                     top_p: float = 1.0, generator: torch.Generator | None = None) -> list[int]:
    """Up to `max_new_tokens` bytes after `prompt_ids` (through the first end-of-sequence id):
    greedy at temperature 0, else drawn from softmax(logits / T) within the top-p nucleus."""
    device = model.get_input_embeddings().weight.device
    eos = set(eos_token_ids)
    out = model(input_ids=torch.tensor([prompt_ids], device=device), use_cache=True,
                position_ids=torch.arange(len(prompt_ids), device=device)[None])
    cache, new = out.past_key_values, []
    while True:
        token = int(sample_next(out.logits[:, -1], temperature, top_p, generator)[0])
        new.append(token)
        if token in eos or len(new) == max_new_tokens:
            return new
        position = len(prompt_ids) + len(new) - 1
        out = model(input_ids=torch.tensor([[token]], device=device), past_key_values=cache, use_cache=True,
                    position_ids=torch.tensor([[position]], device=device))
