"""Gated-LoRA drafts under speculative sampling (drafts=sample): each speculation is drawn from the
head's tempered distribution q and verified against it, and the output through the real `decode()`
is distributed as the target's (a chi-square test on the joint of the first 3 tokens, which covers
drafts accepted at depths 1 and 2); the Draft carries q rows aligned with its tokens."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from chisquare import chi2_pvalue, reference_probs
from mtpkit.models.decoding.decoder import Target, decode
from mtpkit.models.gated_lora import to_inference
from mtpkit.models.gated_lora.drafter import GatedLoRADraftConfig, GatedLoRADrafter
from tests.models.test_gated_lora import make_gated

VOCAB, PROMPT, NEW = 5, [0, 3, 1], 3
LIKELY = [4, 4]  # the target's likeliest path after PROMPT (p = 0.61, then 0.57 after 4)


@pytest.fixture(scope="module")
def small():
    """A seeded 2-layer Llama over 5 tokens (the one of tests/eval/test_decoder.py): the joint of
    3 tokens has 125 cells, enumerated exactly."""
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.5,
                         tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        return LlamaForCausalLM(config).eval()


def close_head(base, k=2):
    """A gated head whose q is close to the target's p on purpose, so drafts get accepted at
    depths 1 and 2 and a wrong q shows in the output (with a random sampler MLP about 1 draft in 6
    is accepted at depth 1 here, and a wrong q there would hardly change the output).

    - The mask embeddings are the token embeddings of the target's likeliest path and the LoRA
      delta is small (random, non-zero): mask i after a node then reads almost like that token,
      so its row (W z_i, the base head) is close to the target's own next-token distribution
      along that path, yet not equal (rejections and residuals happen too).
    - The sampler MLP([E(y_prev); z]) is set to about LayerNorm(z + 3 E(y_prev)): each block's
      Linear adds a bias of 10 that puts SiLU in its linear range, and LayerNorm removes the
      shift. So the sampler's q stays near the base head's but depends strongly on the drawn
      parent y_{i-1} (a chain whose q rows must be the ones conditioned on the tokens drawn).
    """
    gated = make_gated(base, k=k, rank=4, seed=5)
    with torch.no_grad():
        for name, p in gated.named_parameters():
            if "lora_B" in name:
                p.mul_(0.1)
        gated.mask_embeds.copy_(gated.embed.weight[LIKELY[:k]])
        first, second = gated.sampler.blocks[0], gated.sampler.blocks[3]
        d = second.weight.shape[0]
        first.weight.copy_(torch.cat([3 * torch.eye(d), torch.eye(d)], dim=1))
        second.weight.copy_(torch.eye(d))
        first.bias.fill_(10.0)
        second.bias.fill_(10.0)
    return to_inference(gated)


@torch.no_grad()
def exact_joint(model, temperature: float, top_p: float) -> torch.Tensor:
    """[V, V, V] target probability of the first 3 generated tokens, by enumeration."""
    def probs(ids):
        return reference_probs(model(input_ids=torch.tensor([ids])).logits[0, -1], temperature, top_p)

    joint = probs(PROMPT)[:, None, None].repeat(1, VOCAB, VOCAB)
    for a in range(VOCAB):
        second = probs(PROMPT + [a])
        joint[a] *= second[:, None]
        for b in range(VOCAB):
            joint[a, b] *= probs(PROMPT + [a, b])
    return joint


def sampled_joint(target, drafter, runs: int, temperature: float, top_p: float):
    """[V, V, V] counts of the first 3 tokens over `runs` decodes, and the accepted drafts per depth."""
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(VOCAB, VOCAB, VOCAB, dtype=torch.long)
    accepted = [0, 0]
    for _ in range(runs):
        result = decode(target, drafter, PROMPT, NEW, temperature=temperature, top_p=top_p, generator=g)
        counts[tuple(result.tokens)] += 1
        for depth, n in enumerate(result.accept_counts[:2]):
            accepted[depth] += n
    return counts, accepted


@pytest.mark.parametrize("decoding,sampler,temperature,top_p", [
    ("quadratic", True, 1.0, 1.0), ("quadratic", True, 0.7, 1.0), ("linear", False, 0.7, 0.9)])
def test_sampled_drafts_are_exact(small, decoding, sampler, temperature, top_p):
    """The first 3 tokens follow the target joint at T = 1.0 and 0.7 (where an untempered q
    differs from the q drawn from) and under top_p, with the sampler's chain (quadratic) and the
    base head (linear), and drafts were accepted at depths 1 and 2 (so q decided acceptances)."""
    config = GatedLoRADraftConfig(decoding=decoding, sampler=sampler, seed=1)
    drafter = GatedLoRADrafter(config, model=close_head(small))
    target = Target(*drafter.adapt(None, {}))
    counts, accepted = sampled_joint(target, drafter, 1000, temperature, top_p)
    assert accepted[0] > 200 and accepted[1] > 50, accepted  # the drafts' q mattered, at both depths
    assert chi2_pvalue(counts, exact_joint(small, temperature, top_p)) > 1e-3, \
        "speculative sampling with gated-LoRA drafts is not distributed as the target"


def drafts_and_steps(drafter, target, temperature, top_p=1.0, new_tokens=12):
    """Every (step observed, draft proposed after it) of one decode."""
    seen, drafts = [], []
    observe, propose = drafter.observe, drafter.propose
    drafter.observe = lambda step: (seen.append((step, dict(drafter.blocks))), observe(step))
    drafter.propose = lambda tokens: drafts.append(propose(tokens)) or drafts[-1]
    decode(target, drafter, PROMPT, new_tokens, temperature=temperature, top_p=top_p,
           generator=torch.Generator().manual_seed(3))
    return list(zip(seen, drafts[1:]))


@pytest.mark.parametrize("sampler,top_p", [(False, 1.0), (True, 1.0), (False, 0.8), (True, 0.8)])
@torch.no_grad()
def test_draft_probs_are_the_q_each_token_was_drawn_from(small, sampler, top_p, temperature=0.8):
    """drafts=sample at T > 0: draft_probs is [N, V], each row a distribution giving its token
    q > 0, and equal to the head's distribution at T (and top_p) computed here from the step's
    outputs (mask rows through W, or the sampler chained on the drawn tokens, the bonus first)."""
    model = close_head(small)
    drafter = GatedLoRADrafter(GatedLoRADraftConfig(decoding="quadratic", sampler=sampler), model=model)
    target = Target(*drafter.adapt(None, {}))
    pairs = drafts_and_steps(drafter, target, temperature, top_p)
    assert len(pairs) > 2
    for (step, blocks), draft in pairs:
        N, q = draft.num_nodes, draft.draft_probs
        assert N == 2 and q.shape == (N, VOCAB)
        torch.testing.assert_close(q.sum(-1), torch.ones(N))
        assert (q[torch.arange(N), torch.tensor(draft.tokens)] > 0).all()
        z = step.hidden[blocks[step.last_node]]  # [k, d]
        if sampler:
            prev = [step.new_tokens[-1]] + list(draft.tokens)[:-1]
            logits = model.sampler_logits(torch.tensor(prev), z)
        else:
            logits = model.lm_head(z)
        want = torch.stack([reference_probs(row, temperature, top_p) for row in logits]).float()
        torch.testing.assert_close(q, want)


@pytest.mark.parametrize("drafts,temperature", [("argmax", 0.8), ("sample", 0.0), ("argmax", 0.0)])
def test_argmax_drafts_and_greedy_decoding_stay_one_hot(small, drafts, temperature):
    """drafts=argmax under sampling, and greedy decoding whatever drafts says: the speculations are
    the argmax (draft_probs None, one-hot for the verifier), as before drafts=sample existed."""
    model = close_head(small)
    drafter = GatedLoRADrafter(GatedLoRADraftConfig(decoding="quadratic", sampler=False, drafts=drafts), model=model)
    target = Target(*drafter.adapt(None, {}))
    pairs = drafts_and_steps(drafter, target, temperature)
    assert pairs
    for (step, blocks), draft in pairs:
        assert draft.draft_probs is None
        assert list(draft.tokens) == model.lm_head(step.hidden[blocks[step.last_node]]).argmax(-1).tolist()
