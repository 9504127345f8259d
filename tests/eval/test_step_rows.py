"""The bench's x-rows floor (`mtpkit.eval.step_rows`): a plain forward of a step's rows, timed
between decodes on the method's own target."""

import pytest
import torch

from mtpkit.eval.step_rows import RowsFloor, decode_rows
from mtpkit.models.decoding.decoder import DecodeResult, Target, decode
from mtpkit.models.decoding.drafter import Drafter
from mtpkit.models.pld import PLDConfig, PLDDrafter


@pytest.mark.parametrize("cache", ["slab", "dynamic"])
def test_a_floor_forward_leaves_its_cache_as_it_found_it(tiny, cache):
    """Each timed forward drops its rows again: the next one runs on the same cache_len positions
    (a growing `DynamicCache` would make each forward attend to more)."""
    model, _ = tiny
    floor = RowsFloor(Target(model, cache=cache), cache_len=30)
    assert floor.cache.length == 30
    for rows in (1, 5, 1):
        assert floor.ms(rows) > 0
        assert floor.cache.length == 30 and floor.cache.hf.get_seq_length() == 30
    assert floor.warm == {1, 5}


def test_decode_rows_counts_each_decoding_steps_rows(tiny):
    """The prefill step is left out: AR's decoding steps are 1 row each, whatever the prompt length;
    a drafter's steps are counted by their own row counts, which add up to its decoding rows."""
    model, _ = tiny
    prompt = list(range(10, 30)) * 2
    ar = decode(Target(model), Drafter(), prompt, 12)
    assert ar.prefill_tokens >= len(prompt) and decode_rows(ar) == {1: ar.target_calls - 1}
    pld = decode(Target(model), PLDDrafter(PLDConfig(draft_len=4, ngram_max=2)), prompt, 12)
    rows = decode_rows(pld)
    assert len(rows) > 1  # the repeated prompt: some steps draft, some do not
    assert sum(rows.values()) == pld.target_calls - 1
    assert sum(r * n for r, n in rows.items()) == pld.forward_tokens - pld.prefill_tokens
    assert decode_rows(DecodeResult(tokens=[1], target_calls=1, forward_tokens=20, prefill_tokens=20)) is None


def test_the_floor_of_a_row_mix_weights_each_row_counts_forward_by_its_steps(tiny, monkeypatch):
    model, _ = tiny
    floor = RowsFloor(Target(model), cache_len=30)
    monkeypatch.setattr(floor, "ms", lambda rows: 10.0 * rows)  # a forward's time, known
    assert floor.mix({1: 3, 4: 1}) == pytest.approx((3 * 10 + 40) / 4)  # not the forward of round(7/4) = 2 rows
    # beyond the `most` most frequent row counts the rare ones are left out
    assert floor.mix({1: 5, 2: 4, 3: 3, 4: 2, 50: 1}) == pytest.approx((50 + 80 + 90 + 80) / 14)


def test_a_floor_of_several_rows_is_a_causal_chain_on_the_additive_mask(tiny):
    """The floor's rows see the cache and the rows before them, as the decoder's chain steps do:
    its hidden states equal the same forward under the model's own causal mask."""
    model, _ = tiny
    floor = RowsFloor(Target(model), cache_len=30)
    assert floor.mask(1) is None and floor.mask(4).shape == (1, 1, 4, 34)
    with torch.no_grad():
        ours = model.model(input_ids=floor.new[:, :4], position_ids=floor.positions[:, :4], attention_mask=floor.mask(4),
                           past_key_values=floor.cache.hf, use_cache=True).last_hidden_state
        floor.cache.compact(30, [])
        own = model.model(input_ids=floor.new[:, :4], position_ids=floor.positions[:, :4],
                          past_key_values=floor.cache.hf, use_cache=True).last_hidden_state
        floor.cache.compact(30, [])
    assert torch.allclose(ours, own, atol=1e-6)


def test_x_loop_takes_the_drafters_own_time_out_of_x_rows():
    from types import SimpleNamespace

    from mtpkit.eval.bench_results import step_floors

    setup = SimpleNamespace(compile_s={}, targets={}, host_reads={}, floor_ms={"m": [10.0, 12.0, 11.0], "ar": [5.0]})
    results = {"methods": {"m": {"decode_step_ms": 13.0, "decode_draft_ms": 2.0}, "ar": {"decode_step_ms": 5.5}}}
    step_floors(results, setup, SimpleNamespace())
    m, ar = results["methods"]["m"], results["methods"]["ar"]
    assert m["rows_ms"] == 11.0 and m["x_rows"] == round(13 / 11, 4) and m["x_loop"] == 1.0
    assert ar["x_rows"] == 1.1 and "x_loop" not in ar  # no drafting time recorded: no claim about it
