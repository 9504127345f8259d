"""The CPU's attention for decoding (`mtpkit.models.attention`): a masked step of several rows on
grouped KV heads equals transformers' sdpa bit for bit, and packed CPU targets take it."""

import copy

import torch

from mtpkit.models import attention
from mtpkit.models.attention import use_grouped_sdpa
from mtpkit.models.decoding.decoder import Target, decode
from mtpkit.models.kernel_plan import pack_targets
from mtpkit.models.decoding.drafter import Draft, Drafter
from transformers import DynamicCache


def masked_step(model, prompt, rows, mask):
    cache = DynamicCache()
    with torch.no_grad():
        model.model(input_ids=prompt, past_key_values=cache, use_cache=True)
        pos = torch.arange(prompt.shape[1], prompt.shape[1] + rows.shape[1])[None]
        return model.model(input_ids=rows, attention_mask=mask, position_ids=pos, past_key_values=cache,
                           use_cache=True).last_hidden_state


def test_a_masked_step_on_grouped_heads_equals_sdpa_bit_for_bit(tiny, monkeypatch):
    model, _ = tiny
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # grouped heads to repeat
    grouped = copy.deepcopy(model)
    assert use_grouped_sdpa(grouped) and grouped.config._attn_implementation == attention.NAME
    prompt, rows = torch.randint(0, 200, (1, 9)), torch.randint(0, 200, (1, 4))
    mask = torch.zeros(1, 1, 4, 13)
    mask[0, 0, 1:, 10] = torch.finfo(torch.float32).min  # a tree: rows 1-3 do not see row 0
    reference = masked_step(model, prompt, rows, mask)
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(k.get("enable_gqa")) or real(*a, **k))
    assert torch.equal(masked_step(grouped, prompt, rows, mask), reference)
    layers = model.config.num_hidden_layers
    assert calls[-layers:] == [True] * layers  # the masked step's every layer took the grouped path


def test_packed_cpu_targets_decode_trees_on_grouped_sdpa_equal_to_ar(tiny):
    model, _ = tiny
    packed = copy.deepcopy(model)
    pack_targets(packed, linear="onednn")
    assert packed.config._attn_implementation == attention.NAME
    prompt = list(range(10, 30)) * 2
    truth = decode(Target(packed), Drafter(), prompt, 24).tokens  # AR: one row a step, no mask
    run = decode(Target(packed), ForkedOracle(truth, len(prompt)), prompt, 24)  # trees: masked steps
    assert run.tokens == truth and sum(run.accept_counts) >= 24 // 3

    stock = copy.deepcopy(model)
    pack_targets(stock, linear="stock")
    assert stock.config._attn_implementation == "sdpa"  # torch's untouched layers keep transformers' attention


class ForkedOracle(Drafter):
    """Knows AR's reply; drafts a tree [wrong, next] with the token after next under `next`: a tree
    (a mask) of which two nodes are accepted."""

    def __init__(self, reply: list[int], prompt_len: int):
        self.reply, self.prompt_len = reply, prompt_len

    def propose(self, tokens):
        at = len(tokens) - self.prompt_len
        nxt, after = (self.reply + [0, 0])[at:at + 2]
        return Draft(tokens=torch.tensor([(nxt + 1) % 200, nxt, after]), parents=torch.tensor([0, 0, 2]))
