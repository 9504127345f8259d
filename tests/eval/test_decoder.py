"""The speculative decoder through real models: lossless greedy decoding for every drafter, the
decode statistics, KV-cache rollback, and exact speculative sampling."""

import random
import time
from typing import NamedTuple

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import mtpkit.models.decoding.decoder as decoder_module
from chisquare import chi2_pvalue, reference_probs
from mtpkit.data.chat import load_examples, prompt_ids
from mtpkit.models.decoding.cache import CACHES, SlabCache, new_cache
from mtpkit.models.decoding.decoder import Target, decode
from mtpkit.models.generate import generate
from mtpkit.models.decoding.verify import attention_inputs
from mtpkit.models.decoding.drafter import Draft, Drafter
from mtpkit.models.pld import PLDConfig, PLDDrafter
from mtpkit.models.probe import ProbeConfig, ProbeDrafter

USER_TEXTS = [
    "Write a Python function that adds two numbers.",
    "What is 17 times 23?",
    "Summarise: the quick brown fox jumps over the lazy dog. The dog sleeps.",
]
NEW_TOKENS = 48

DRAFTERS = {
    "ar": Drafter,
    "pld-len1": lambda: PLDDrafter(PLDConfig(draft_len=1)),
    "pld-len4-ngram2": lambda: PLDDrafter(PLDConfig(draft_len=4, ngram_max=2)),
    "pld-len10": lambda: PLDDrafter(PLDConfig(draft_len=10)),
    "probe-bc10": lambda: ProbeDrafter(ProbeConfig(bc=10)),
    "probe-bc30": lambda: ProbeDrafter(ProbeConfig(bc=30)),
    "probe-bc60": lambda: ProbeDrafter(ProbeConfig(bc=60)),
    "probe-bc30-2masks": lambda: ProbeDrafter(ProbeConfig(bc=30, masks=2)),
    "probe-bc30-tree7-2": lambda: ProbeDrafter(ProbeConfig(bc=30, masks=2, tree="7-2")),
    "probe-bc10-hard": lambda: ProbeDrafter(ProbeConfig(bc=10, init="hard")),
    "probe-bc10-sample-noprune": lambda: ProbeDrafter(ProbeConfig(bc=10, init="sample", prune=False)),
}


def _greedy_reference(model, tokenizer, ids, max_new_tokens):
    """Plain AR greedy continuation (the reference every drafter must reproduce)."""
    return generate(model, [ids], max_new_tokens, [tokenizer.eos_token_id], tokenizer.pad_token_id)[0]


@pytest.fixture(scope="module", params=["tiny", "tiny_byte"])
def tiny_case(request):
    """(target, tokenizer, prompts, AR references) for one tiny backbone, built once per module."""
    model, tokenizer = request.getfixturevalue(request.param)
    prompts = [prompt_ids(tokenizer, [{"role": "user", "content": text}]) for text in USER_TEXTS]
    refs = [_greedy_reference(model, tokenizer, ids, NEW_TOKENS) for ids in prompts]
    return Target(model), tokenizer, prompts, refs


# --------------------------------------------------------------------------- 4. greedy is lossless

@pytest.mark.parametrize("path", ["device", "lazy"])
@pytest.mark.parametrize("drafter_name", DRAFTERS)
def test_greedy_decode_equals_ar_generate(tiny_case, drafter_name, path):
    """Greedy speculative decoding with any drafter reproduces plain AR generation token for token,
    on a small head's device path (every row's logits in one call, one argmax read) and on the
    CPU's lazy path (logits row by row as acceptance asks, an argmax read per visited node)."""
    target, tokenizer, prompts, refs = tiny_case
    if path == "lazy":
        target = Target(target.model, prefetch_rows=0, device_rows=0)
    proposed = accepted = 0
    for ids, ref in zip(prompts, refs):
        result = decode(target, DRAFTERS[drafter_name](), ids, NEW_TOKENS, eos_token_ids=[tokenizer.eos_token_id])
        assert result.tokens == ref, f"{drafter_name}: greedy decode diverges from AR generate"
        proposed += result.draft_nodes
        accepted += sum(result.accept_counts)
        if drafter_name == "ar":
            assert result.draft_nodes == 0 and result.target_calls == len(ref)
    if drafter_name != "ar":
        assert proposed > 0, "the drafter never proposed anything: the tree path was not exercised"
        # only an accepted draft's logits and cache rows reach the output: without one, a wrong
        # verification would pass this test
        assert accepted > 0, "no draft token was accepted: verification was not exercised"


def test_a_small_heads_logits_come_in_one_call_a_step(tiny_case):
    """A CPU step's rows on a small LM head (this one's every row costs less than `DEVICE_PATH_MACS`)
    take the device path: their logits in one call; on the lazy path (device_rows=0) a drafting step
    calls it per visited row."""
    target, tokenizer, prompts, _ = tiny_case
    calls = []

    def counted(t):
        head = t.lm_head
        t.lm_head = lambda hidden: calls.append(len(hidden)) or head(hidden)
        return t

    drafter = PLDDrafter(PLDConfig(draft_len=4, ngram_max=2))
    prompt = prompts[0] * 2  # repeated: its steps draft
    assert target.device_rows >= 64
    one = decode(counted(Target(target.model)), drafter, prompt, 24)
    assert len(calls) == one.target_calls and one.draft_nodes > 0
    every = sum(calls)  # every row of every step
    calls.clear()
    rows = decode(counted(Target(target.model, device_rows=0)), drafter, prompt, 24)
    assert rows.tokens == one.tokens and set(calls[1:]) == {1} and sum(calls) < every  # the visited rows alone


# --------------------------------------------------------------------------- 5. oracle drafter

class Proposal(NamedTuple):
    tokens: list[int]   # draft tokens
    parents: list[int]  # draft parents (0 = root)
    extras: int         # extra nodes
    correct: int        # length of the correct prefix of the true path: what greedy must accept
    true_len: int       # length of the true path proposed (correct or not)


class OracleDrafter(Drafter):
    """Knows the reference continuation; proposes random trees holding it along one path (wrong
    from a random depth on, or not at all), with wrong siblings, wrong subtrees under them and
    random extra nodes. Records its proposals and the StepOutputs the verifier reports back."""

    name = "oracle"

    def __init__(self, reference: list[int], vocab_size: int, seed: int):
        self.reference, self.vocab_size, self.seed = reference, vocab_size, seed

    def begin(self, target, prompt_ids):
        self.rng = random.Random(self.seed)
        self.gen = torch.Generator().manual_seed(self.seed)
        self.embed_std = float(target.embed.weight.std())
        self.hidden_size = target.config.hidden_size
        self.prompt_len = len(prompt_ids)
        self.proposals: list[Proposal] = []
        self.steps = []

    def _wrong(self, avoid: int) -> int:
        return self.rng.choice([t for t in range(self.vocab_size) if t != avoid])

    def propose(self, tokens):
        rng, pos = self.rng, len(tokens) - self.prompt_len
        truth = self.reference[pos: pos + rng.randint(1, 7)]
        corrupt_at = rng.randrange(len(truth) + 3)  # >= len(truth): the whole true path is right
        nodes, parents = [], []

        def add(token, parent):
            nodes.append(token)
            parents.append(parent)
            return len(nodes)  # its step index

        node = 0
        for d, true_token in enumerate(truth):
            main = true_token if d < corrupt_at else self._wrong(true_token)
            order = [self._wrong(true_token) for _ in range(rng.randint(0, 2))] + [main]
            rng.shuffle(order)  # the path's node is not always the first sibling
            here = [add(t, node) for t in order]
            main_node = here[order.index(main)]
            for sibling in here:
                if sibling != main_node and rng.random() < 0.3:
                    add(self._wrong(-1), sibling)  # a subtree under a wrong sibling
            node = main_node
        extras = rng.randint(0, 3)
        extra_parents = [rng.randrange(1 + len(nodes) + m) for m in range(extras)]  # any earlier node
        self.proposals.append(Proposal(nodes, parents, extras, min(corrupt_at, len(truth)), len(truth)))
        return Draft(tokens=torch.tensor(nodes, dtype=torch.long), parents=torch.tensor(parents, dtype=torch.long),
                     extra_embeds=self.embed_std * torch.randn(extras, self.hidden_size, generator=self.gen) if extras else None,
                     extra_parents=torch.tensor(extra_parents, dtype=torch.long) if extras else None)

    def observe(self, step):
        self.steps.append(step)


def _check_step_outputs(oracle: OracleDrafter):
    """Every StepOutput is a root-to-node path of the proposed tree, of exactly the correct
    prefix's length, with its tokens followed by one bonus token."""
    assert len(oracle.steps) == len(oracle.proposals)
    for proposal, step in zip(oracle.proposals, oracle.steps):
        assert step.hidden.shape[0] == 1 + len(proposal.tokens) + proposal.extras
        assert len(step.accepted) == proposal.correct, "greedy did not accept exactly the correct prefix"
        chain = [0] + step.accepted
        assert all(proposal.parents[b - 1] == a for a, b in zip(chain, chain[1:])), "accepted nodes are not a path"
        assert step.last_node == chain[-1]
        assert step.new_tokens[:-1] == [proposal.tokens[a - 1] for a in step.accepted]
        assert len(step.new_tokens) == len(step.accepted) + 1


def _decode_with_oracle(tiny_case, seed, **kw):
    """Greedy decode of prompt `seed % 3` with an oracle knowing its AR reference:
    (prompt ids, reference, oracle, DecodeResult)."""
    target, tokenizer, prompts, refs = tiny_case
    ids, ref = prompts[seed % len(prompts)], refs[seed % len(prompts)]
    oracle = OracleDrafter(ref, target.config.vocab_size, seed)
    kw.setdefault("eos_token_ids", [tokenizer.eos_token_id])
    return ids, ref, oracle, decode(target, oracle, ids, kw.pop("max_new_tokens", NEW_TOKENS), **kw)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_oracle_trees_accept_long_paths_and_stay_lossless(tiny_case, seed):
    """With long acceptances and rejections at random depths (and extra nodes to drop from the
    cache), greedy decoding still equals AR; the DecodeResult statistics add up."""
    ids, ref, oracle, result = _decode_with_oracle(tiny_case, seed)
    assert result.tokens == ref, "greedy decode with oracle trees diverges from AR generate"
    assert result.tau > 1.5, f"tau {result.tau:.2f}: acceptance was barely exercised"
    _check_step_outputs(oracle)
    accepted = [len(step.accepted) for step in oracle.steps]
    assert max(accepted) >= 3, "no long acceptance"
    assert any(p.correct < p.true_len for p in oracle.proposals), "no true-path token was rejected"

    # statistics: calls, per-depth acceptance counts, proposed nodes, forward positions
    assert result.target_calls == len(oracle.steps)
    assert result.accept_counts == [sum(a > d for a in accepted) for d in range(max(accepted))]
    emitted = [t for step in oracle.steps for t in step.new_tokens]
    assert len(emitted) == sum(result.accept_counts) + result.target_calls
    assert result.tokens == emitted[: len(result.tokens)]  # only the last step may be cut short
    assert len(emitted) - len(result.tokens) < len(oracle.steps[-1].new_tokens)
    assert result.draft_nodes == sum(len(p.tokens) for p in oracle.proposals)
    assert result.forward_tokens == len(ids) + result.target_calls - 1 + sum(len(p.tokens) + p.extras for p in oracle.proposals)


def test_stops_inside_an_accepted_path_at_eos_and_max_new_tokens(tiny_case):
    """An end-of-sequence token or the token budget reached in the middle of a step's accepted
    path ends the output exactly there, as AR generation does."""
    target, tokenizer, prompts, refs = tiny_case
    ref = refs[0]
    _, _, oracle, result = _decode_with_oracle(tiny_case, 0, max_new_tokens=5)
    assert len(oracle.steps[0].new_tokens) > 5, "setup: the first step should overshoot the budget"
    assert result.tokens == ref[:5]

    # declare an end-of-sequence token that the oracle run accepts inside a path (not as a bonus)
    _, _, full_run, _ = _decode_with_oracle(tiny_case, 0)
    steps = full_run.steps
    starts = [sum(len(s.new_tokens) for s in steps[:i]) for i in range(len(steps))]
    at = next(start for start, step in zip(starts, steps) if step.accepted and ref.index(ref[start]) == start)
    expected = generate(target.model, [prompts[0]], NEW_TOKENS, [ref[at]], tokenizer.pad_token_id)[0]
    assert expected == ref[: at + 1]
    _, _, oracle, result = _decode_with_oracle(tiny_case, 0, eos_token_ids=[ref[at]])
    assert sum(len(s.new_tokens) for s in oracle.steps) > len(result.tokens), "setup: eos should be mid-step"
    assert result.tokens == expected


def test_the_drafters_own_time_is_counted_apart(tiny_case):
    """`draft_seconds` holds the drafter's `propose` and `observe`, and nothing of the target."""
    target = tiny_case[0]

    class Slow(Drafter):
        def propose(self, tokens):
            time.sleep(0.01)
            return super().propose(tokens)

        def observe(self, step):
            time.sleep(0.005)

    result = decode(target, Slow(), tiny_case[2][0], 4)
    assert result.target_calls == 4 and 0.06 <= result.draft_seconds < result.seconds - result.target_seconds
    # the first step's propose and observe (the prefill's), apart from the decoding steps'
    assert 0.015 <= result.prefill_draft_seconds <= result.draft_seconds - 0.045
    assert decode(target, Drafter(), tiny_case[2][0], 4).draft_seconds < 0.01


# --------------------------------------------------------------------------- 6. default backbone

def test_greedy_decode_equals_ar_on_the_default_backbone(smollm2):
    """On SmolLM2-135M: AR, prompt lookup and the probe reproduce generate() on a built-in prompt."""
    model, tokenizer = smollm2
    examples, _ = load_examples("builtin")
    ids = prompt_ids(tokenizer, examples[0].messages)  # a code prompt: prompt lookup finds matches
    ref = _greedy_reference(model, tokenizer, ids, 16)  # 16 tokens: each drafter has a draft accepted
    target = Target(model)
    for drafter in [Drafter(), PLDDrafter(), ProbeDrafter(ProbeConfig(bc=10))]:
        result = decode(target, drafter, ids, 16, eos_token_ids=[tokenizer.eos_token_id])
        assert result.tokens == ref, f"{drafter.name}: greedy decode diverges from AR generate on smollm2"
        if drafter.name != "ar":
            assert sum(result.accept_counts) > 0, f"{drafter.name}: no draft accepted on smollm2"


# --------------------------------------------------------------------------- 7. KV-cache rollback

def _causal_cache(body, ids):
    cache = DynamicCache(config=body.config)
    body(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
    return cache


# draft tree (draft parents, 0 = root): 1, 2 under the root; 3 under 1; 4, 5 under 2; 6 under 5
TREE_TOKENS = [11, 12, 13, 14, 15, 16]
TREE_PARENTS = [0, 0, 1, 2, 2, 5]


def _kv(cache, layer: int):
    """(keys, values) a decoding cache holds for `layer`, its kept positions only."""
    if isinstance(cache, SlabCache):
        return cache.kv[layer, 0, ..., : cache.length, :], cache.kv[layer, 1, ..., : cache.length, :]
    return cache.hf.layers[layer].keys, cache.hf.layers[layer].values


@pytest.mark.parametrize("kind", [k for k in CACHES if k != "static"])  # static: tests/eval/test_step.py
@pytest.mark.parametrize("prefill", [False, True], ids=["root-step", "prefill-step"])
@pytest.mark.parametrize("accepted", [[2, 5, 6], [1, 3], [2], [1], []],
                         ids=["path-2-5-6", "path-1-3", "path-2", "path-1-in-place", "none"])
def test_compacted_cache_equals_a_causal_cache_of_the_accepted_tokens(tiny, prefill, accepted, kind):
    """After a tree step (drafts and extra nodes) and compaction, each decoding cache holds what a
    cache built causally from the accepted sequence holds, and the next token's logits through it
    are those of a fresh full forward. The slab starts too small for the step (it must grow)."""
    model, _ = tiny
    body = model.get_decoder()
    prompt = [5, 40, 41, 42, 43, 44, 45]
    with torch.no_grad():
        # the step's context: the whole prompt (prefill) or only the root after a cached past
        past, context = ([], prompt) if prefill else (prompt[:-1], prompt[-1:])
        cache = new_cache(kind, model.config, 4)
        if past:
            cache.reserve(len(past))
            body(input_ids=torch.tensor([past]), past_key_values=cache.hf, use_cache=True)
            cache.compact(len(past), [])
        c, root, N = len(context), len(context) - 1, len(TREE_TOKENS)
        extra_parents = [2, 6, N + 1]  # step indices: under drafts 2 and 6, and under the first extra
        parents = list(range(-1, c - 1)) + [p + root for p in TREE_PARENTS + extra_parents]
        embeds = torch.cat([model.get_input_embeddings()(torch.tensor(context + TREE_TOKENS)),
                            torch.randn(len(extra_parents), model.config.hidden_size, generator=torch.Generator().manual_seed(0))])
        mask, position_ids = attention_inputs(tuple(parents), len(past), torch.float32)
        cache.reserve(len(parents))
        body(inputs_embeds=embeds[None], attention_mask=mask, position_ids=position_ids,
             past_key_values=cache.hf, use_cache=True)

        keep = len(past) + c
        cache.compact(keep, [a + keep - 1 for a in accepted])
        sequence = prompt + [TREE_TOKENS[a - 1] for a in accepted]
        fresh = _causal_cache(body, sequence)
        assert cache.length == cache.hf.get_seq_length() == len(sequence)
        for i, ref in enumerate(fresh.layers):
            keys, values = _kv(cache, i)
            torch.testing.assert_close(keys, ref.keys, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(values, ref.values, atol=1e-5, rtol=1e-4)

        nxt = 77
        cache.reserve(1)
        continued = model(input_ids=torch.tensor([[nxt]]), position_ids=torch.tensor([[len(sequence)]]),
                          past_key_values=cache.hf, use_cache=True).logits[0, -1]
        full = model(input_ids=torch.tensor([sequence + [nxt]])).logits[0, -1]
        torch.testing.assert_close(continued, full, atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------- 8. exact sampling

VOCAB = 5
PROMPT = [1, 2, 3]
# decodes per distribution test: each planted bug below (the bonus drawn from the target's p, the
# temperature or the nucleus left out, a tree's siblings tested against p instead of the residual)
# fails its test at p < 1e-10 with 600 runs
RUNS = 600


@pytest.fixture(scope="module")
def small_vocab_model():
    """A seeded 2-layer Llama over 5 tokens, so the 2-token joint can be enumerated."""
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.5,
                         tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)  # a seed whose first two target distributions are spread out
        model = LlamaForCausalLM(config).eval()
    return model


@pytest.fixture(scope="module", params=["device", "lazy"])
def small_vocab_target(request, small_vocab_model):
    """The 5-token model on a small head's device path (the draws made over every row at once) and
    on the CPU's lazy path (rows drawn as the walk visits them, `verify_sampling`)."""
    return Target(small_vocab_model, device_rows=0 if request.param == "lazy" else None)


class SampledChainDrafter(Drafter):
    """Proposes 2 tokens drawn i.i.d. from a fixed q, with draft_probs = q per node."""

    def __init__(self, q: torch.Tensor, seed: int):
        self.q, self.gen = q, torch.Generator().manual_seed(seed)  # seeded once: fresh drafts every run

    def propose(self, tokens):
        return Draft(tokens=torch.multinomial(self.q, 2, replacement=True, generator=self.gen),
                     parents=torch.arange(2), draft_probs=self.q.repeat(2, 1))


class FixedChainDrafter(Drafter):
    """Proposes the same 2 tokens every step, deterministically (draft_probs None)."""

    def __init__(self, tokens: list[int]):
        self.tokens = tokens

    def propose(self, tokens):
        return Draft.chain(self.tokens)


def _exact_joint(target: Target, top_p: float, temperature: float = 1.0) -> torch.Tensor:
    """[V, V] target probability of the first two generated tokens, by enumeration."""
    with torch.no_grad():
        probs = lambda ids: reference_probs(target.model(input_ids=torch.tensor([ids])).logits[0, -1], temperature, top_p)
        first = probs(PROMPT)
        second = torch.stack([probs(PROMPT + [x]) for x in range(VOCAB)])
    return first[:, None] * second


def _two_token_counts(target, drafter, runs, top_p=1.0, seed=0, temperature=1.0) -> torch.Tensor:
    """[V, V] counts of the first two tokens over `runs` sampled decodes."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.long)
    for _ in range(runs):
        x1, x2 = decode(target, drafter, PROMPT, 2, temperature=temperature, top_p=top_p, generator=g).tokens
        counts[x1, x2] += 1
    return counts


def _sampling_matches(target, drafter, runs=RUNS, top_p=1.0, temperature=1.0) -> bool:
    """True if sampled decodes pass a chi-square test (p = 0.001) against the exact joint."""
    counts = _two_token_counts(target, drafter, runs, top_p, temperature=temperature)
    return chi2_pvalue(counts, _exact_joint(target, top_p, temperature)) > 1e-3


# unlike the target (about [0.49, 0.14, 0.01, 0.16, 0.20] after the prompt), so rejections are
# frequent; tokens 1 and 2 are outside the top_p = 0.8 nucleus
Q = torch.tensor([0.05, 0.1, 0.4, 0.15, 0.3])


def _wrong_verify_sampling(probs, children, tokens, draft_probs, generator=None):
    """A WRONG rule: accepts with min(1, p/q) but draws the bonus from the unmodified target p."""
    node, path = 0, []
    while True:
        p = probs(node)
        child = next(iter(children[node]), None)  # chains only
        if child is not None:
            x = tokens[child]
            q = draft_probs[child - 1] if draft_probs is not None else torch.eye(len(p))[x]
            if torch.rand((), generator=generator) < torch.clamp(p[x] / q[x], max=1.0):
                path.append(child)
                node = child
                continue
        return path, node, int(torch.multinomial(p, 1, generator=generator))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_speculative_sampling_is_exact_with_sampled_drafts(small_vocab_target, temperature):
    """Chains drawn from q, verified by rejection sampling: the 2-token output is target-distributed
    (at T = 0.7 too, where a temperature applied the wrong way changes the target)."""
    assert _sampling_matches(small_vocab_target, SampledChainDrafter(Q, seed=1), temperature=temperature), \
        "speculative sampling output is not distributed as the target"


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_speculative_sampling_is_exact_with_deterministic_drafts(small_vocab_target, temperature):
    """Deterministic chains (q one-hot): the 2-token output is target-distributed."""
    assert _sampling_matches(small_vocab_target, FixedChainDrafter([0, 1]), temperature=temperature), \
        "speculative sampling with deterministic drafts is not distributed as the target"


class SampledTreeDrafter(Drafter):
    """Proposes a tree: two siblings under the root drawn i.i.d. from q, a child of the first
    drawn from q, and a deterministic third sibling (one-hot q), so recursive rejection sampling
    walks siblings, residuals and depth 2 through the real decoder. Counts what it got accepted."""

    def __init__(self, q: torch.Tensor, fixed: int, seed: int):
        self.q, self.fixed, self.gen = q, fixed, torch.Generator().manual_seed(seed)
        self.accepted = 0

    def propose(self, tokens):
        drawn = torch.multinomial(self.q, 3, replacement=True, generator=self.gen)
        one_hot = torch.nn.functional.one_hot(torch.tensor(self.fixed), len(self.q)).float()
        return Draft(tokens=torch.cat([drawn, torch.tensor([self.fixed])]), parents=torch.tensor([0, 0, 1, 0]),
                     draft_probs=torch.stack([self.q, self.q, self.q, one_hot]))

    def observe(self, step):
        self.accepted += len(step.accepted)


def test_speculative_sampling_through_the_decoder_is_exact_with_tree_drafts(small_vocab_target, temperature=0.7):
    """Sampled trees with sibling drafts through decode() at T = 0.7: the output follows the target
    joint, and drafts were accepted at both depths (so the residual after a rejected sibling mattered)."""
    drafter = SampledTreeDrafter(Q, fixed=3, seed=4)
    assert _sampling_matches(small_vocab_target, drafter, temperature=temperature), \
        "speculative sampling over draft trees is not distributed as the target"
    res = decode(small_vocab_target, drafter, PROMPT, 30, temperature=temperature,
                 generator=torch.Generator().manual_seed(5))
    assert drafter.accepted > 0 and len(res.accept_counts) == 2, res.accept_counts


def test_speculative_sampling_is_exact_under_top_p(small_vocab_target):
    """With top_p = 0.8 the output follows the nucleus-truncated target joint (and never leaves it)."""
    assert _sampling_matches(small_vocab_target, SampledChainDrafter(Q, seed=2), top_p=0.8), \
        "speculative sampling under top_p is not distributed as the nucleus-truncated target"


def test_the_sampling_check_catches_a_wrong_acceptance_rule(small_vocab_model, monkeypatch):
    """The same check rejects a decoder whose rule skips the residual distribution: it has power
    (the rule planted is the lazy path's, `verify_sampling`)."""
    monkeypatch.setattr(decoder_module, "verify_sampling", _wrong_verify_sampling)
    assert not _sampling_matches(Target(small_vocab_model, device_rows=0), SampledChainDrafter(Q, seed=3), runs=500), \
        "the sampling check fails to flag a wrong acceptance rule"
