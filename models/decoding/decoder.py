"""The one speculative decoder: every drafter (none = plain AR) runs through `decode`.

Each step is ONE target forward over [context..., draft nodes..., extra nodes...] with a 4D
tree mask and explicit position ids on a KV cache; the context is the whole prompt at the
first step (prefill) and the last accepted token (the root) after that. Acceptance is greedy
or speculative sampling (`mtpkit.models.decoding.verify`); the cache is then rolled back to the accepted
path. The LM head runs only on the rows that acceptance and the drafter actually read, one
call per request, each row once per step; on a packed LM head (`pack_linears`: a few rows cost
about one) every row of a step of at most `PREFETCH_ROWS` rows is computed in the step's first
call instead.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from mtpkit.models.arch import adapter_for
from mtpkit.models.generate import target_probs
from mtpkit.models.decoding.verify import attention_inputs, verify_greedy, verify_sampling, walk_greedy
from mtpkit.models.decoding.drafter import Drafter, StepOutput
from mtpkit.models.trees import children_of
from mtpkit.models.packed_linear import PackedLinear, cpu_paths

# on a packed LM head, steps of up to this many rows get their logits in one call. Reading the
# weight dominates a large LM head's cost (SmolLM2's is 49152 x 576), so one call over up to 16
# rows costs less than the ~3 one-row calls of a lazy greedy step (`eval/bench.py --prefetch-rows`
# compares the two)
PREFETCH_ROWS = 16


class Target:
    """The target model split into body (hidden states) and LM head, so logits are lazy. Both
    come from the architecture's adapter (`mtpkit.models.arch`): on a multi-byte LM head
    (EvaByte) `lm_head` gives the next-byte head's logits only, the target's own distribution."""

    def __init__(self, model, gate=None, prefetch_rows: int | None = None):
        self.model = model
        self.gate = gate  # gated-LoRA models: `gate(mask)` switches the adapter on for extra nodes
        self.adapter = adapter_for(model)
        self.body = self.adapter.body
        self.lm_head = self.adapter.lm_head
        self.embed = model.get_input_embeddings()
        self.config = model.config
        self.dtype = self.embed.weight.dtype
        # the CPU-only paths (lazy per-row LM head, per-node argmax reads) apply: see `decode`;
        # a test sets it False to run the device path on a CPU
        self.cpu_paths = cpu_paths(self.device)
        if prefetch_rows is None:
            prefetch_rows = PREFETCH_ROWS if isinstance(self.lm_head, PackedLinear) else 0
        self.prefetch_rows = prefetch_rows
        with torch.no_grad():  # refuse models whose logits are more than lm_head(hidden)
            ids = torch.tensor([[1, 2, 3]], device=self.embed.weight.device)
            split = self.lm_head(self.body(input_ids=ids).last_hidden_state)
            if not torch.equal(split.float(), model(input_ids=ids).logits.float()):  # fp32 logits of a bf16 head
                raise ValueError(f"{type(model).__name__}: logits are not lm_head(last hidden state) "
                                 "(softcapping or scaling?); the decoder cannot compute them lazily")

    @property
    def device(self):
        return self.embed.weight.device


@dataclass
class DecodeResult:
    """Tokens generated for one prompt and the statistics of the run."""
    tokens: list[int]
    target_calls: int = 0
    accept_counts: list[int] = field(default_factory=list)  # [d]: steps whose depth-(d+1) draft was accepted
    draft_nodes: int = 0          # draft tokens proposed in total
    forward_tokens: int = 0       # input positions fed to the target in total (block complexity)
    seconds: float = 0.0
    target_seconds: float = 0.0   # time inside the target (body forwards + LM head rows); the rest
                                  # is decoder bookkeeping and drafting

    @property
    def tau(self) -> float:
        return len(self.tokens) / max(self.target_calls, 1)


def rollback_cache(cache: DynamicCache, keep: int, accepted: list[int] | torch.Tensor) -> None:
    """Keep cache positions [0, keep) and the accepted positions `accepted` (absolute, >= keep;
    host ints, or a tensor read once), moved to keep, keep+1, ...; everything else (rejected
    nodes, extra nodes) is dropped. Accepted positions that already sit at keep, keep+1, ... (a
    chain's accepted prefix) are kept by slicing, without copying the cache."""
    positions = accepted.tolist() if isinstance(accepted, torch.Tensor) else list(accepted)
    if positions == list(range(keep, keep + len(positions))):
        keep, positions = keep + len(positions), []
    index = None
    for layer in cache.layers:
        if positions:
            if index is None:  # one host-to-device copy for every layer
                index = torch.tensor(positions, device=layer.keys.device)
            layer.keys = torch.cat([layer.keys[..., :keep, :], layer.keys[..., index, :]], dim=-2)
            layer.values = torch.cat([layer.values[..., :keep, :], layer.values[..., index, :]], dim=-2)
        else:
            layer.keys = layer.keys[..., :keep, :]
            layer.values = layer.values[..., :keep, :]


@torch.no_grad()
def decode(target: Target, drafter: Drafter, prompt_ids: list[int], max_new_tokens: int,
           temperature: float = 0.0, top_p: float = 1.0, eos_token_ids=(),
           generator: torch.Generator | None = None,
           on_tokens: Callable[[list[int]], None] | None = None) -> DecodeResult:
    """Generate up to `max_new_tokens` tokens after `prompt_ids` with `drafter` proposing.

    Two paths, one result: with `target.cpu_paths` (a CPU) the LM head runs lazily on the rows
    acceptance and the drafter read, and greedy acceptance reads one argmax per visited node; on
    a GPU every row goes through the LM head in one call and greedy acceptance is ONE host read
    per step (the argmax of every row with the draft tokens), so the device never waits on the
    host in between (tests/eval/test_host_syncs.py counts the reads). `on_tokens`, when given,
    gets each step's accepted tokens as the step ends (what `result.tokens` gains: cut at an EOS
    and at `max_new_tokens`), for streaming."""
    started = time.perf_counter()
    eos = set(eos_token_ids)
    cache = DynamicCache(config=target.config)
    drafter.sampling = temperature > 0
    drafter.temperature = temperature
    drafter.top_p = top_p
    drafter.begin(target, prompt_ids)
    tokens = list(prompt_ids)
    context = list(prompt_ids)  # fed as a causal chain; its last token is the root
    cache_len = 0
    result = DecodeResult(tokens=[])
    while len(result.tokens) < max_new_tokens:
        draft = drafter.propose(tokens)
        c, N, M = len(context), draft.num_nodes, draft.num_extras
        root = c - 1
        draft_parents = draft.parents.tolist() if N else []  # host data (`Draft`): no device read
        # parents over the whole forward: a chain for the context, then drafts and extras
        # whose indices (0 = root) are shifted to sit after the context
        parents = list(range(-1, c - 1)) + [p + root for p in draft_parents]
        if M:
            parents += [p + root for p in draft.extra_parents.tolist()]
        # the draft tokens may be on the device (a drafter's argmax): they are not read here
        ids = torch.cat([torch.tensor(context, device=target.device), draft.tokens.to(target.device)])
        embeds = target.embed(ids)[None]  # [1, c+N, d]
        if M:
            embeds = torch.cat([embeds, draft.extra_embeds.to(embeds)[None]], dim=1)
        if all(p == i - 1 for i, p in enumerate(parents)):
            # a plain chain (AR, prompt lookup): the model's own causal mask is exact and lets
            # attention take its unmasked fast path
            mask = None
            position_ids = torch.arange(cache_len, cache_len + len(parents), device=target.device)[None]
        else:
            layout = draft.layout if c == 1 else None  # a bank's tree: laid out for a root-only context
            mask, position_ids = attention_inputs(tuple(parents) if layout is None else (), cache_len,
                                                  target.dtype, target.device, layout=layout)

        gated = contextlib.nullcontext()
        if target.gate is not None:  # the adapter is on for the extra nodes (mask tokens) only
            # built on the host: the gate reads its rows from the mask, which would be a sync on a GPU
            gated = target.gate(torch.arange(c + N + M)[None] >= c + N)
        t0 = time.perf_counter()
        with gated:
            out = target.body(inputs_embeds=embeds, attention_mask=mask, position_ids=position_ids,
                              past_key_values=cache, use_cache=True,
                              output_hidden_states=drafter.shared_layer is not None)
        hidden = out.last_hidden_state[0, root:]  # [1+N+M, d]
        shared = None if drafter.shared_layer is None else out.hidden_states[drafter.shared_layer][0]
        result.target_seconds += time.perf_counter() - t0
        result.target_calls += 1
        result.draft_nodes += N
        result.forward_tokens += c + N + M

        if target.cpu_paths:
            computed: dict[int, torch.Tensor] = {}

            def logits(rows: list[int]) -> torch.Tensor:  # step rows (0 = root) -> [len(rows), V]
                batch = range(len(hidden)) if not computed and len(hidden) <= target.prefetch_rows else rows
                missing = [r for r in batch if r not in computed]
                if missing:
                    t1 = time.perf_counter()
                    for r, row in zip(missing, target.lm_head(hidden[missing]).float()):
                        computed[r] = row
                    result.target_seconds += time.perf_counter() - t1
                return torch.stack([computed[r] for r in rows])
        else:  # the device path: every row in one LM-head call (on a GPU a row costs about nothing)
            t1 = time.perf_counter()
            every = target.lm_head(hidden).float()  # [1+N+M, V]
            result.target_seconds += time.perf_counter() - t1

            def logits(rows: list[int]) -> torch.Tensor:
                return every[rows]

        children = draft.children if draft.children is not None else children_of(draft_parents, 1 + N)
        choices = None  # the target's argmax of every row, when read at once
        if temperature <= 0 and not target.cpu_paths:
            # the acceptance decision in one host read: every row's argmax, then the draft tokens
            read = torch.cat([every.argmax(-1), draft.tokens.to(target.device)]).tolist()
            choices, step_tokens = read[: len(hidden)], [context[-1]] + read[len(hidden):]
            accepted, last, bonus = walk_greedy(choices.__getitem__, children, step_tokens)
        elif temperature <= 0:
            step_tokens = [context[-1]] + draft.tokens.tolist()
            accepted, last, bonus = verify_greedy(lambda n: logits([n])[0], children, step_tokens)
        else:
            step_tokens = [context[-1]] + draft.tokens.tolist()
            accepted, last, bonus = verify_sampling(
                lambda n: target_probs(logits([n]), temperature, top_p)[0], children, step_tokens,
                draft.draft_probs, generator)

        keep = cache_len + c
        new = [step_tokens[a] for a in accepted] + [bonus]
        next_context = [bonus]
        if drafter.drop_bonus(len(accepted), N):
            # e.g. MTPC's Algorithm 2: the newest kept token becomes the next root and is fed
            # again (its KV leaves the cache), so its state comes with the next forward
            new, next_context = new[:-1], [step_tokens[accepted[-1]] if accepted else context[-1]]
            keep_nodes = accepted[:-1]
            keep -= 0 if accepted else 1
        else:
            keep_nodes = accepted
        rollback_cache(cache, keep, [n + cache_len + c - 1 for n in keep_nodes])
        cache_len = keep + len(keep_nodes)
        for depth in range(len(accepted)):
            if depth == len(result.accept_counts):
                result.accept_counts.append(0)
            result.accept_counts[depth] += 1
        drafter.observe(StepOutput(accepted=accepted, last_node=last, new_tokens=new, hidden=hidden,
                                   logits=logits, context_len=c, shared_hidden=shared, choices=choices))
        sent = len(result.tokens)  # what on_tokens has had
        tokens += new
        result.tokens += new
        context = next_context
        hit = next((i for i, t in enumerate(new) if t in eos), None)
        if hit is not None:
            result.tokens = result.tokens[: len(result.tokens) - len(new) + hit + 1]
        if on_tokens is not None:
            on_tokens(result.tokens[sent:max_new_tokens])
        if hit is not None:
            break
    result.tokens = result.tokens[:max_new_tokens]
    result.seconds = time.perf_counter() - started
    return result
