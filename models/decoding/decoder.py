"""The one speculative decoder: every drafter (none = plain AR) runs through `decode`.

Each step is ONE target forward over [context..., draft nodes..., extra nodes...] with a 4D
tree mask and explicit position ids on a KV cache; the context is the whole prompt at the
first step (prefill) and the last accepted token (the root) after that. Acceptance is greedy
or speculative sampling (`mtpkit.models.decoding.verify`); the cache is then rolled back to the accepted
path. The LM head runs only on the rows that acceptance and the drafter actually read, one
call per request, each row once per step; on a packed LM head (`pack_linears`: a few rows cost
about one) every row of a step of at most `PREFETCH_ROWS` rows is computed in the step's first
call instead. On a small LM head (a byte vocabulary: a step's every row within `DEVICE_PATH_MACS`
multiply-adds) a CPU step takes the device path instead: every row's logits in one call, one
argmax over them, one read.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from mtpkit.models.arch import adapter_for
from mtpkit.models.decoding.cache import new_cache
from mtpkit.models.generate import target_probs
from mtpkit.models.decoding.step import StepBank, check_step
from mtpkit.models.decoding.verify import (accept_on_device, attention_inputs, path_to, read_decision,
                                           sample_on_device, verify_greedy, verify_sampling, walk_greedy)
from mtpkit.models.decoding.drafter import Drafter, StepOutput
from mtpkit.models.decoding.window import fit_window, host_ints
from mtpkit.models.trees import children_of, tree_layout
from mtpkit.models.packed_linear import PackedLinear, cpu_paths

# on a packed LM head, steps of up to this many rows get their logits in one call. Reading the
# weight dominates a large LM head's cost (SmolLM2's is 49152 x 576), so one call over up to 16
# rows costs less than the ~3 one-row calls of a lazy greedy step
PREFETCH_ROWS = 16
# a CPU step whose every row's logits cost at most this many multiply-adds takes the device path
# (`Target.device_rows`): on a small LM head (a byte vocabulary) one call over every row and one
# argmax read cost less than the Python of a call and a read per visited row
DEVICE_PATH_MACS = 1 << 22


class Target:
    """The target model split into body (hidden states) and LM head, so logits are lazy. Both
    come from the architecture's adapter (`mtpkit.models.arch`): on a multi-byte LM head
    (EvaByte) `lm_head` gives the next-byte head's logits only, the target's own distribution."""

    def __init__(self, model, gate=None, prefetch_rows: int | None = None, cache: str = "slab",
                 step: str = "eager", max_len: int = 2048, device_rows: int | None = None):
        self.model = model
        self.cache = cache  # the decoding cache's kind (`mtpkit.models.decoding.cache.CACHES`)
        # how a decoding step runs (`mtpkit.models.decoding.step.STEPS`): eager (dynamic shapes on
        # `cache`), or one fixed-shape step per tree shape on a static slab of `max_len` positions
        check_step(step, model.get_input_embeddings().weight.device)
        self.step = step
        self.max_len = max_len
        self.steps: StepBank | None = None  # made at the first decode: the static slab and the steps
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
        self.uploads = 0  # host-to-device copies of the decoding loop (`upload`)
        self._layouts: dict[int, tuple] = {}
        with torch.no_grad():  # refuse models whose logits are more than lm_head(hidden)
            ids = torch.tensor([[1, 2, 3]], device=self.embed.weight.device)
            hidden = self.body(input_ids=ids).last_hidden_state
            split = self.lm_head(hidden)
            if not torch.equal(split.float(), model(input_ids=ids).logits.float()):  # fp32 logits of a bf16 head
                raise ValueError(f"{type(model).__name__}: logits are not lm_head(last hidden state) "
                                 "(softcapping or scaling?); the decoder cannot compute them lazily")
        if prefetch_rows is None:
            prefetch_rows = PREFETCH_ROWS if isinstance(self.lm_head, PackedLinear) else 0
        self.prefetch_rows = prefetch_rows
        # on a CPU, steps of up to this many rows take the device path (`decode`); a test sets 0 to
        # run the CPU's lazy path on a small head
        if device_rows is None:
            device_rows = DEVICE_PATH_MACS // (split.shape[-1] * hidden.shape[-1])  # a row's multiply-adds
        self.device_rows = device_rows

    @property
    def device(self):
        return self.embed.weight.device

    def upload(self, values: list[int]) -> torch.Tensor:
        """Host ints as a long tensor on the target's device: on a GPU from pinned memory without
        blocking (the host goes on while the copy runs). Every host-to-device copy of the
        decoder's loop goes through here; `uploads` counts them."""
        self.uploads += 1
        out = torch.tensor(values, dtype=torch.long)
        if self.device.type == "cpu":
            return out
        return out.pin_memory().to(self.device, non_blocking=True)

    def layout_on_device(self, layout: tuple[torch.Tensor, torch.Tensor],
                         keep: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """A tree layout's (allowed, depth) on the device, copied once per layout (a bank's trees and
        the `tree_layout` cache hold theirs for the whole run); `keep=False`: copied, not kept (a
        prefill's layout spans its prompt and serves one step)."""
        if not keep:
            self.uploads += 1
            return tuple(t.to(self.device, non_blocking=True) for t in layout)
        key = id(layout)
        found = self._layouts.get(key)
        if found is None or found[0] is not layout:
            if len(self._layouts) >= 512:
                self._layouts.pop(next(iter(self._layouts)))
            self.uploads += 1
            found = (layout, tuple(t.to(self.device, non_blocking=True) for t in layout))
            self._layouts[key] = found
        return found[1]

    def begin_steps(self, rows: int):
        """The static slab emptied for a decode of up to `rows` positions (the StepBank made once)."""
        if self.steps is None:
            self.steps = StepBank(self, self.step, self.max_len)
        return self.steps.begin(rows)


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
    draft_seconds: float = 0.0    # time inside the drafter (`propose` and `observe`: its own heads' work)
    prefill_draft_seconds: float = 0.0  # of it, within the first step (`prefill_seconds`)
    prefill_tokens: int = 0       # input positions of the first step (the prompt, and a first draft)
    prefill_seconds: float = 0.0  # the first step's time, drafting included: the rest are decoding steps
    compile_seconds: float = 0.0  # capturing or compiling fixed steps (`Target.step`), not in `seconds`
    # each decoding step (prefill out): (rows, of them extras, seconds, of them the drafter's), for
    # per-shape statistics (`mtpkit.eval.step_rows`: medians robust to the host's stalls)
    step_times: list[tuple[int, int, float, float]] = field(default_factory=list)

    @property
    def tau(self) -> float:
        return len(self.tokens) / max(self.target_calls, 1)


def step_layout(target: Target, draft, parents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoding step's tree layout on the device (the draft's precompiled one, else built from the
    step's parents), copied once per layout."""
    return target.layout_on_device(draft.layout if draft.layout is not None else tree_layout(tuple(parents)))


def eager_forward(target: Target, drafter: Drafter, draft, cache, ids: torch.Tensor, parents: list[int],
                  c: int, N: int, M: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One step's target forward with dynamic shapes (the prefill, and every step of the eager
    decoder): [1+N+M, d] hidden states of the root onwards, and the shared layer's states."""
    root, cache_len = c - 1, cache.length
    embeds = target.embed(ids)[None]  # [1, c+N, d]
    if M:
        embeds = torch.cat([embeds, draft.extra_embeds.to(embeds)[None]], dim=1)
    if all(p == i - 1 for i, p in enumerate(parents)) and (len(parents) == 1 or cache_len == 0):
        # one row, or a chain on an empty cache (the prompt): no mask at all, attention's
        # unmasked path (a chain of several rows on a cache takes the additive mask below:
        # the model's own would be a boolean one, converted again in every layer)
        mask = None
        position_ids = torch.arange(cache_len, cache_len + len(parents), device=target.device)[None]
    else:
        layout = draft.layout if c == 1 and draft.layout is not None else tree_layout(tuple(parents))
        mask, position_ids = attention_inputs((), cache_len, target.dtype, target.device,
                                              layout=target.layout_on_device(layout, keep=c == 1))
    gated = contextlib.nullcontext()
    if target.gate is not None:  # the adapter is on for the extra nodes (mask tokens) only
        gated = target.gate.suffix(c + N, c + N + M)
    with gated:
        out = target.body(inputs_embeds=embeds, attention_mask=mask, position_ids=position_ids,
                          past_key_values=cache.hf, use_cache=True,
                          output_hidden_states=drafter.shared_layer is not None)
    hidden = out.last_hidden_state[0, root:]  # [1+N+M, d]
    shared = None if drafter.shared_layer is None else out.hidden_states[drafter.shared_layer][0]
    return hidden, shared


def signal_at(drafter: Drafter, node, hidden: torch.Tensor, every: torch.Tensor, bonus) -> torch.Tensor | None:
    """The drafter's `step_signal` at the deepest accepted `node` (a one-element device index, or
    the root's slice), computed on the device to travel in the step's one host read; `bonus()`
    gives the bonus token there. None when the drafter wants none (nothing computed)."""
    if not drafter.wants_signal:
        return None
    if isinstance(node, slice):
        return drafter.step_signal(hidden[node], every[node], bonus())
    return drafter.step_signal(hidden.index_select(0, node), every.index_select(0, node), bonus())


@torch.no_grad()
def decode(target: Target, drafter: Drafter, prompt_ids: list[int], max_new_tokens: int,
           temperature: float = 0.0, top_p: float = 1.0, eos_token_ids=(),
           generator: torch.Generator | None = None,
           on_tokens: Callable[[list[int]], None] | None = None) -> DecodeResult:
    """Generate up to `max_new_tokens` tokens after `prompt_ids` with `drafter` proposing.

    Two paths, one result: with `target.cpu_paths` (a CPU) the LM head runs lazily on the rows
    acceptance and the drafter read, and greedy acceptance reads one argmax per visited node
    (but for a step within `target.device_rows`: a small head's, on the device path); on a GPU
    every row goes through the LM head in one call and greedy acceptance is ONE host read
    per step (the argmax of every row with the draft tokens), so the device never waits on the
    host in between (tests/eval/test_host_syncs.py counts the reads); speculative sampling there is
    one read too (`sample_on_device`: deterministic drafts, chain or tree, and chains of drawn
    drafts; a tree of drawn drafts is walked on the host). A drafter's numbers computed from the
    deepest accepted node (`Drafter.step_signal`: a tree schedule's signal) travel in that read.
    `on_tokens`, when given,
    gets each step's accepted tokens as the step ends (what `result.tokens` gains: cut at an EOS
    and at `max_new_tokens`), for streaming."""
    started = time.perf_counter()
    eos = set(eos_token_ids)
    static = target.step != "eager"  # fixed-shape steps on the Target's static slab
    # room for the whole reply and a wide step; the dynamic cache grows if a step would not fit
    room = len(prompt_ids) + max_new_tokens + 64
    cache = target.begin_steps(room) if static else new_cache(target.cache, target.config, room, target.upload)
    lazy = target.cpu_paths and not static  # the CPU's lazy per-row LM head (a fixed step computes every row)
    drafter.sampling = temperature > 0
    drafter.temperature = temperature
    drafter.top_p = top_p
    drafter.begin(target, prompt_ids)
    tokens = list(prompt_ids)
    context = list(prompt_ids)  # fed as a causal chain; its last token is the root
    context_ids = target.upload(context)  # the same on the device: after the first step a view of the
    result = DecodeResult(tokens=[])      # last step's tensors (the bonus: the target's argmax)
    while len(result.tokens) < max_new_tokens:
        # a step stays in the target's attention window (EvaByte): a draft past its end is cut there
        t0 = step_started = time.perf_counter()
        compiled_before, drafted_before = result.compile_seconds, result.draft_seconds
        proposed = drafter.propose(tokens)
        result.draft_seconds += time.perf_counter() - t0
        draft, restore = fit_window(target, proposed, cache.length + len(context) - 1)
        c, N, M = len(context), draft.num_nodes, draft.num_extras
        root, cache_len = c - 1, cache.length
        cache.reserve(c + N + M)
        draft_parents = host_ints(draft.parents) if N else []  # host data (`Draft`): no device read
        # parents over the whole forward: a chain for the context, then drafts and extras
        # whose indices (0 = root) are shifted to sit after the context
        parents = list(range(-1, c - 1)) + [p + root for p in draft_parents]
        if M:
            parents += [p + root for p in host_ints(draft.extra_parents)]
        # draft tokens made on the device (a drafter's argmax) stay there, unread; host ints are uploaded
        host_tokens = None if isinstance(draft.tokens, torch.Tensor) else list(draft.tokens)
        draft_ids = None if not N else target.upload(host_tokens) if host_tokens is not None else draft.tokens
        ids = torch.cat([context_ids, draft_ids.to(target.device)]) if N else context_ids
        layout = None  # a decoding step's tree layout on the device, once: its fixed step's and its acceptance's
        t0 = time.perf_counter()
        if static and c == 1:  # a decoding step: its shape's fixed step (captured or compiled at first use)
            layout = step_layout(target, draft, parents)
            shape = target.steps.step(tuple(parents), layout, 1 + N, M, drafter.shared_layer is not None)
            before = shape.compile_seconds
            hidden, every, argmaxes, states = shape.run(ids, draft.extra_embeds)
            result.compile_seconds += shape.compile_seconds - before
            t0 += shape.compile_seconds - before
            shared = None if states is None else states[drafter.shared_layer][0]
        else:
            hidden, shared = eager_forward(target, drafter, draft, cache, ids, parents, c, N, M)
            every = argmaxes = None
        result.target_seconds += time.perf_counter() - t0
        result.target_calls += 1
        result.draft_nodes += N
        result.forward_tokens += c + N + M
        if result.target_calls == 1:
            result.prefill_tokens = c + N + M

        lazy_step = lazy and len(hidden) > target.device_rows  # a small head's step: the device path
        if lazy_step:
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
            if every is None:
                t1 = time.perf_counter()
                every = target.lm_head(hidden).float()  # [1+N+M, V]
                result.target_seconds += time.perf_counter() - t1

            def logits(rows: list[int]) -> torch.Tensor:  # a run of rows is a view: no index to copy
                if rows and rows == list(range(rows[0], rows[0] + len(rows))):
                    return every[rows[0]: rows[0] + len(rows)]
                return every[target.upload(rows)]

        children = draft.children if draft.children is not None else children_of(draft_parents, 1 + N)
        chain = all(p == i for i, p in enumerate(draft_parents))
        choices = None  # the target's argmax of every row, when read at once
        signal = None  # the drafter's `step_signal`, when read with the decision
        decision = None  # the device's (last accepted node, bonus) of a sampled step
        device_tokens = host_tokens is None and N
        if temperature <= 0 and not lazy_step:
            # the acceptance decision in one host read: the path and length accepted on the device
            # (a drafted tree), every row's argmax (the drafters read them), the device's draft tokens
            if argmaxes is None:
                argmaxes = every.argmax(-1)
            if N and c == 1:  # a decoding step's draft: accepted on the device
                if not chain and layout is None:
                    layout = step_layout(target, draft, parents)
                best = accept_on_device(argmaxes, ids[: 1 + N], None if chain else layout)
                node = best.view(1)
                wanted = signal_at(drafter, node, hidden, every, lambda: argmaxes.index_select(0, node))
                read, signal = read_decision(torch.cat([best[None], argmaxes] + ([draft_ids] if device_tokens else [])),
                                             wanted)
                choices = read[1: 1 + len(hidden)]
                step_tokens = [context[-1]] + (read[1 + len(hidden):] if device_tokens else host_tokens)
                last = read[0]
                accepted = path_to(last, draft_parents)
                bonus = choices[last]
            else:  # AR, or the prefill's draft: every row's argmax (and the draft tokens) read, walked here
                # (without a draft the last accepted node is the root, row 0)
                wanted = None if N else signal_at(drafter, slice(0, 1), hidden, every, lambda: argmaxes[:1])
                read, signal = read_decision(torch.cat([argmaxes] + ([draft_ids] if device_tokens else [])), wanted)
                choices = read[: len(hidden)]
                step_tokens = [context[-1]] + (read[len(hidden):] if device_tokens else host_tokens or [])
                accepted, last, bonus = walk_greedy(choices.__getitem__, children, step_tokens)
        elif temperature <= 0:
            step_tokens = [context[-1]] + (host_tokens if host_tokens is not None else draft.tokens.tolist())
            accepted, last, bonus = verify_greedy(lambda n: logits([n])[0], children, step_tokens)
        elif not lazy_step and (draft.draft_probs is None or chain and isinstance(draft.draft_probs, torch.Tensor)):
            # speculative sampling on the device (`sample_on_device`): the draws, the accepted node and
            # the bonus made there, then read at once with the device's draft tokens (drawn drafts whose
            # rows are made lazily, as MTPC's, walk on the host: it asks only for the rows it visits)
            if not chain and layout is None:
                layout = step_layout(target, draft, parents) if c == 1 else \
                    target.layout_on_device(tree_layout(tuple([-1] + draft_parents)))
            probs = target_probs(logits(list(range(1 + N))), temperature, top_p)
            decision = sample_on_device(probs, ids[root: root + 1 + N], draft.draft_probs,
                                        None if chain else layout, generator)
            wanted = signal_at(drafter, decision[:1], hidden, every, lambda: decision[1:])
            read, signal = read_decision(torch.cat([decision] + ([draft_ids] if device_tokens else [])), wanted)
            last, bonus = read[0], read[1]
            step_tokens = [context[-1]] + (read[2:] if device_tokens else host_tokens or [])
            accepted = path_to(last, draft_parents)
        else:
            step_tokens = [context[-1]] + (host_tokens if host_tokens is not None else draft.tokens.tolist())
            accepted, last, bonus = verify_sampling(
                lambda n: target_probs(logits([n]), temperature, top_p)[0], children, step_tokens,
                draft.draft_probs, generator)

        keep = cache_len + c
        new = [step_tokens[a] for a in accepted] + [bonus]
        next_context = [bonus]
        # the next context on the device, where it is already there: a view of this step's tensors
        next_ids = argmaxes[last: last + 1] if choices is not None else \
            decision[1:] if decision is not None else None
        if drafter.drop_bonus(len(accepted), N):
            # e.g. MTPC's Algorithm 2: the newest kept token becomes the next root and is fed
            # again (its KV leaves the cache), so its state comes with the next forward
            node = accepted[-1] if accepted else 0
            new, next_context = new[:-1], [step_tokens[node]]
            next_ids = ids[root + node: root + node + 1]
            keep_nodes = accepted[:-1]
            keep -= 0 if accepted else 1
        else:
            keep_nodes = accepted
        cache.compact(keep, [n + cache_len + c - 1 for n in keep_nodes])
        for depth in range(len(accepted)):
            if depth == len(result.accept_counts):
                result.accept_counts.append(0)
            result.accept_counts[depth] += 1
        t0 = time.perf_counter()
        drafter.observe(restore(StepOutput(accepted=accepted, last_node=last, new_tokens=new, hidden=hidden,
                                           logits=logits, context_len=c, shared_hidden=shared, choices=choices,
                                           signal=signal)))
        result.draft_seconds += time.perf_counter() - t0
        if result.target_calls == 1:
            result.prefill_seconds = time.perf_counter() - started - result.compile_seconds
            result.prefill_draft_seconds = result.draft_seconds
        else:
            result.step_times.append((c + N + M, M, time.perf_counter() - step_started
                                      - (result.compile_seconds - compiled_before),
                                      result.draft_seconds - drafted_before))
        sent = len(result.tokens)  # what on_tokens has had
        tokens += new
        result.tokens += new
        context = next_context
        context_ids = next_ids if next_ids is not None else target.upload(context)
        hit = next((i for i, t in enumerate(new) if t in eos), None)
        if hit is not None:
            result.tokens = result.tokens[: len(result.tokens) - len(new) + hit + 1]
        if on_tokens is not None:
            on_tokens(result.tokens[sent:max_new_tokens])
        if hit is not None:
            break
    result.tokens = result.tokens[:max_new_tokens]
    result.seconds = time.perf_counter() - started - result.compile_seconds
    return result


def tokens_per_call(target: Target, drafter: Drafter, prompts: list[list[int]], max_new_tokens: int,
                    eos_token_ids=()) -> float:
    """Greedy tau over several prompts: the tokens generated per target call (the trainers' sim_tau)."""
    tokens = calls = 0
    for ids in prompts:
        res = decode(target, drafter, ids, max_new_tokens, eos_token_ids=eos_token_ids)
        tokens, calls = tokens + len(res.tokens), calls + res.target_calls
    return tokens / max(calls, 1)
