"""The bench's x-rows floor (`mtpkit.eval.step_rows`): a plain forward of a step's rows, timed
between decodes on the method's own target."""

import pytest

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


def test_decode_rows_is_the_mean_rows_of_the_decoding_steps(tiny):
    """The prefill step is left out: AR's decoding steps are 1 row each, whatever the prompt length."""
    model, _ = tiny
    prompt = list(range(10, 30)) * 2
    ar = decode(Target(model), Drafter(), prompt, 12)
    assert ar.prefill_tokens >= len(prompt) and decode_rows(ar) == 1
    pld = decode(Target(model), PLDDrafter(PLDConfig(draft_len=4, ngram_max=2)), prompt, 12)
    steps = pld.target_calls - 1
    assert decode_rows(pld) == max(1, round((pld.forward_tokens - pld.prefill_tokens) / steps))
    assert decode_rows(DecodeResult(tokens=[1], target_calls=1, forward_tokens=20, prefill_tokens=20)) is None
