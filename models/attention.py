"""The CPU's attention kernel choice for decoding: grouped KV heads passed to torch's kernel as
they are, under a mask too.

transformers' `sdpa` attention repeats each KV head for its query heads (`repeat_kv`: a copy of
every layer's keys and values, four more ops a layer) whenever a step of several rows carries an
attention mask, which every draft-tree step does, because some GPU kernels need it; a plain
forward of as many rows without a mask (the causal default) lets torch group the heads itself
(`enable_gqa`). On a CPU torch's kernel takes `enable_gqa` with a mask and gives the same
result, so `use_grouped_sdpa` switches a target to `grouped_sdpa`: transformers' `sdpa` except
that a masked step of several rows calls torch with `enable_gqa=True`. A GPU keeps `sdpa` (there
a mask with `enable_gqa` falls back to torch's slowest kernel).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

NAME = "mtpkit_grouped_sdpa"


def grouped_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                 is_causal: bool | None = None, **kwargs):
    """transformers' sdpa attention (query [B, H, q, d], key/value [B, Hkv, k, d] -> [B, q, H, d]),
    with a masked step of several rows on grouped KV heads (`enable_gqa`) instead of repeated ones."""
    groups = getattr(module, "num_key_value_groups", 1)
    if (attention_mask is None or groups == 1 or query.shape[2] == 1 or kwargs.get("position_bias") is not None
            or kwargs.get("cache") is not None or kwargs.get("output_attentions", False)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, grouped_sdpa)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


def use_grouped_sdpa(model: torch.nn.Module) -> bool:
    """Switch `model` (on a CPU, on transformers' `sdpa` attention) to `grouped_sdpa`; returns whether
    it did. Other attentions (EvaByte's, eager) and GPUs are left as they are."""
    config = getattr(model, "config", None)
    weight = model.get_input_embeddings().weight
    if config is None or weight.device.type != "cpu" or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    config._attn_implementation = NAME
    return True
