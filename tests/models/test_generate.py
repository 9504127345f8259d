import torch

from mtpkit.data.chat import load_examples, prompt_ids
from mtpkit.models.generate import generate, target_probs


def _hf_greedy(model, tokenizer, ids, max_new_tokens):
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    return out[0, len(ids):].tolist()


def _builtin_prompts(tokenizer, n):
    examples, _ = load_examples("builtin")
    picked = examples[::len(examples) // n][:n]  # spread over the categories
    return [prompt_ids(tokenizer, ex.messages) for ex in picked]


def test_greedy_equals_hf_generate_tiny(tiny):
    model, tokenizer = tiny
    prompts = _builtin_prompts(tokenizer, 6)
    batched = generate(model, prompts, 40, [tokenizer.eos_token_id], tokenizer.pad_token_id)
    for ids, got in zip(prompts, batched):
        ref = _hf_greedy(model, tokenizer, ids, 40)
        assert generate(model, [ids], 40, [tokenizer.eos_token_id], tokenizer.pad_token_id)[0] == ref
        assert got == ref


def test_greedy_equals_hf_generate_default_backbone(smollm2):
    model, tokenizer = smollm2
    prompts = _builtin_prompts(tokenizer, 3)  # of 61, 62 and 41 tokens: the batch is left-padded
    batched = generate(model, prompts, 12, [tokenizer.eos_token_id], tokenizer.pad_token_id)
    for ids, got in zip(prompts, batched):
        ref = _hf_greedy(model, tokenizer, ids, 12)
        assert len(ref) > 0
        assert generate(model, [ids], 12, [tokenizer.eos_token_id], tokenizer.pad_token_id)[0] == ref
        assert got == ref


def test_generation_stops_at_eos_and_pads_nothing(tiny):
    model, tokenizer = tiny
    prompts = _builtin_prompts(tokenizer, 3)
    first = generate(model, prompts[:1], 5, [tokenizer.eos_token_id], tokenizer.pad_token_id)[0]
    # declare the second generated token an end-of-sequence token: generation must stop there
    out = generate(model, prompts[:1], 5, [first[1]], tokenizer.pad_token_id)[0]
    assert out == first[: first.index(first[1]) + 1]


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = target_probs(logits, temperature=1.0, top_p=0.8)
    assert torch.allclose(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    assert torch.allclose(target_probs(logits, 1.0, 1.0), torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
