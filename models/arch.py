"""Architecture adapters: the parts of a backbone that the decoder's `Target` and MTPC read, one
adapter per architecture, looked up by `config.model_type` in `ARCHS` (anything else is
`LlamaArch`).

An adapter gives:
- `body`: the decoder stack called as `body(input_ids= | inputs_embeds=, attention_mask=,
  position_ids=, past_key_values=, use_cache=, output_hidden_states=)`, returning
  `last_hidden_state` (final-normed) and `hidden_states` (entry i = the input of layer i);
- `lm_head`: hidden [.., d] -> the target's own next-token logits [.., V] (what verification
  compares against);
- `vocab_size` V and `head_weights()` [H, V, d]: the backbone's next-token heads, head h
  predicting x_{t+1+h} from e_t (H = 1 for an ordinary LM head; EvaByte: 8);
- `layers`, `norm` and `run_layers(layers, hidden, position_ids, attention_mask, past_key_values)`:
  the decoder layers and how to run a slice of them on given hidden states at given positions
  (MTPC's draft layers run the last L of them on the shared state), and `layer_cache(L)`, the
  cache such a slice keeps across calls;
- `draft_room(position)`: how many draft nodes a step whose root sits at `position` may hold
  (None: any; EvaByte: up to its attention window's end).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache

from mtpkit.models.evabyte.eva import EvaBody, EvaWindowCache, draft_room, own_rows
from mtpkit.models.evabyte.eva import run_layers as eva_run_layers


class LlamaArch:
    """HF decoder-only models with Llama's interface (Llama, SmolLM2, Qwen2, and the byte-level
    Llama-3.2-3B `benjamin/Llama3-2-3B-IT-Byte`, which is a plain `LlamaForCausalLM`): one LM head
    of V rows, layers called with `position_embeddings = body.rotary_emb(x, position_ids)` and a
    4D additive mask (None: causal)."""

    name = "llama"

    def __init__(self, model):
        self.model = model
        self.body = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.vocab_size, rows = model.config.vocab_size, self.lm_head.weight.shape[0]
        if rows != self.vocab_size:
            raise ValueError(f"{type(model).__name__} (model_type {model.config.model_type!r}): the LM head has "
                             f"{rows} rows for a vocabulary of {self.vocab_size}; a multi-token LM head needs "
                             f"an adapter in mtpkit.models.arch.ARCHS (known: {sorted(ARCHS)})")

    def head_weights(self) -> torch.Tensor:
        return self.lm_head.weight[None]  # [1, V, d]

    def draft_room(self, position: int) -> int | None:
        return None

    def layer_cache(self, num_layers: int):
        return DynamicCache()

    @property
    def layers(self) -> nn.ModuleList:
        return self.body.layers

    @property
    def norm(self) -> nn.Module:
        return self.body.norm

    def run_layers(self, layers, hidden: torch.Tensor, position_ids: torch.Tensor, attention_mask=None,
                   past_key_values=None) -> torch.Tensor:
        """hidden [B, T, d] through `layers` at position_ids [B, T] (not normalised)."""
        position_embeddings = self.body.rotary_emb(hidden, position_ids)
        for layer in layers:
            hidden = layer(hidden, attention_mask=attention_mask, position_ids=position_ids,
                           past_key_values=past_key_values, use_cache=past_key_values is not None,
                           position_embeddings=position_embeddings)
            hidden = hidden[0] if isinstance(hidden, tuple) else hidden
        return hidden


class NextByteHead(nn.Module):
    """The first V logits of a multi-head LM head: `heads(x)[..., :V]`, exactly the logits the
    model's own forward returns (it computes the whole head and keeps head 0). Computing every
    head and slicing, rather than multiplying by the first V rows, keeps them bit-identical on
    any kernel; the head is small next to the body (EvaByte: 8 x 320 rows of 4096)."""

    def __init__(self, heads: nn.Module, vocab_size: int):
        super().__init__()
        self.heads, self.vocab_size = heads, vocab_size

    @property
    def weight(self) -> torch.Tensor:
        return self.heads.weight[: self.vocab_size]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.heads(hidden)[..., : self.vocab_size]


class EvaByteArch(LlamaArch):
    """EvaByte (github.com/OpenEvaByte/evabyte, evabyte_hf/modeling_evabyte.py), read from its code:
    - `lm_head = nn.Linear(hidden_size, vocab_size * num_pred_heads)`, and `forward` reshapes the
      logits to [B, T, num_pred_heads, V] and returns head 0 (the next byte) unless
      `return_all_pred_logits`: rows [h V, (h + 1) V) are head h, predicting x_{t+1+h};
    - its attention is EVA (exact within a window of `config.window_size` positions, chunk
      summaries of the finished windows before it) on its own `EvaCache`, which takes one byte
      after the cache and no dense mask. So the body the decoder calls is `EvaBody`
      (`mtpkit.models.evabyte.eva`): exact EVA over a step with a dense tree mask on an
      `EvaWindowCache` (what `new_cache` makes for an evabyte model), the model's own forward
      without a cache. Steps stay in one window: `draft_room`.
    - `run_layers` runs a slice of the layers the same way (MTPC's draft layers), on a fresh
      EVA cache or on `layer_cache(L)` kept across calls, which only appends."""

    name = "evabyte"

    def __init__(self, model):
        self.model = model
        self.body = EvaBody(model.get_decoder())
        heads = model.get_output_embeddings()
        self.vocab_size = V = model.config.vocab_size
        self.num_heads = getattr(model.config, "num_pred_heads", 1) or 1
        if heads.weight.shape[0] != V * self.num_heads:
            raise ValueError(f"EvaByte LM head has {heads.weight.shape[0]} rows, expected vocab_size x "
                             f"num_pred_heads = {V} x {self.num_heads}")
        self.heads = heads
        self.lm_head = NextByteHead(heads, V) if self.num_heads > 1 else heads
        self.window = model.config.window_size

    def head_weights(self) -> torch.Tensor:
        return self.heads.weight.view(self.num_heads, self.vocab_size, -1)  # [H, V, d], head-major rows

    def draft_room(self, position: int) -> int:
        return draft_room(position, self.window)

    def layer_cache(self, num_layers: int) -> EvaWindowCache:
        return EvaWindowCache(num_layers, self.window, self.model.config.chunk_size)

    def run_layers(self, layers, hidden: torch.Tensor, position_ids: torch.Tensor, attention_mask=None,
                   past_key_values=None) -> torch.Tensor:
        """hidden [B, T, d] through `layers` at position_ids [B, T] (not normalised), exact EVA: on a
        fresh cache (causal over T) or on `past_key_values` (a `layer_cache`), which keeps them."""
        cache = past_key_values if past_key_values is not None else self.layer_cache(len(layers))
        own = own_rows(attention_mask, cache.length)
        return eva_run_layers(layers, self.body.rotary_emb, cache, hidden, position_ids, own, commit=True)


ARCHS = {"evabyte": EvaByteArch}


def adapter_for(model) -> LlamaArch | EvaByteArch:
    """The adapter of `model`'s architecture (`config.model_type` in `ARCHS`, else `LlamaArch`)."""
    return ARCHS.get(getattr(model.config, "model_type", ""), LlamaArch)(model)
