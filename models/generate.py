"""Plain batched autoregressive generation with a KV cache (no drafter).

Used by self-distillation (many prompts, left-padded batches) and as the reference that
every speculative method must reproduce token for token under greedy decoding.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


def sample_next(logits: torch.Tensor, temperature: float, top_p: float = 1.0,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [B, V] -> token ids [B]. temperature 0 is greedy (argmax)."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = target_probs(logits, temperature, top_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def target_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """The distribution sampled from: softmax(logits / T), restricted to the top-p nucleus."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


@torch.no_grad()
def generate(model, prompts: list[list[int]], max_new_tokens: int, eos_token_ids: set[int] | list[int],
             pad_token_id: int, temperature: float = 0.0, top_p: float = 1.0,
             generator: torch.Generator | None = None) -> list[list[int]]:
    """Generate continuations for a batch of prompts (token id lists) in one left-padded batch.

    Returns the new tokens of each prompt, up to and including its first end-of-sequence token.
    Everything runs on the model's device; each step reads its B new tokens to the host once
    (on a GPU a read waits for the device).
    """
    device = model.device
    eos = torch.tensor(sorted(set(eos_token_ids)), device=device)
    B, length = len(prompts), max(len(p) for p in prompts)
    input_ids = torch.full((B, length), pad_token_id, dtype=torch.long, device=device)
    attention_mask = torch.zeros(B, length, dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        input_ids[b, length - len(p):] = torch.tensor(p, device=device)
        attention_mask[b, length - len(p):] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    out = [[] for _ in range(B)]
    done = torch.zeros(B, dtype=torch.bool, device=device)
    finished = [False] * B  # `done`, on the host
    eos_set = set(eos_token_ids)
    step_ids = input_ids
    for _ in range(max_new_tokens):
        logits = model(input_ids=step_ids, attention_mask=attention_mask, position_ids=position_ids,
                       past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]  # [B, V]
        next_ids = sample_next(logits, temperature, top_p, generator)
        next_ids = torch.where(done, torch.full_like(next_ids, pad_token_id), next_ids)
        for b, token in enumerate(next_ids.tolist()):  # the step's one host read
            if not finished[b]:
                out[b].append(token)
                finished[b] = token in eos_set
        if all(finished):
            break
        done |= torch.isin(next_ids, eos)
        step_ids = next_ids[:, None]
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(B, 1)], dim=-1)
        position_ids = position_ids[:, -1:] + 1
    return out


def hf_static_compiled(device: torch.device | str) -> dict:
    """`generate` kwargs of transformers' fastest decoding path: its static KV cache with the
    forward under torch.compile ("reduce-overhead", CUDA graphs, on a GPU; the default mode on a
    CPU, where transformers compiles only when told). The first call compiles."""
    from transformers import CompileConfig

    config = CompileConfig(mode="reduce-overhead" if torch.device(device).type == "cuda" else "default")
    config._compile_all_devices = True  # transformers compiles on CUDA only unless told
    return dict(cache_implementation="static", compile_config=config)
