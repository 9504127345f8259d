"""The bench's x-rows floor (`mtpkit.eval.step_rows`): a plain forward of a step's rows, timed
between decodes on the method's own target, against the median steps of the same shapes."""

import pytest
import torch

from mtpkit.eval.step_rows import RowsFloor, decode_floors, redoes_draft, step_mix, top_shapes
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
    assert floor.warm == {(1, 0), (5, 0)}


@pytest.mark.parametrize("cache", ["slab", "dynamic"])
def test_a_floor_moves_to_a_decodes_cache_length_and_back(tiny, cache):
    """A step attends to its whole cache: `at` sets the positions a floor's forwards attend to,
    down and up again within what it prefilled, and refuses more."""
    model, _ = tiny
    floor = RowsFloor(Target(model, cache=cache), cache_len=30, longest=50)
    for length in (30, 12, 50, 40):
        floor.at(length)
        assert floor.ms(3) > 0 and floor.cache.length == length and floor.cache.hf.get_seq_length() == length
        assert floor.positions[0, 0] == length and floor.mask(3).shape[-1] == length + 3
    with pytest.raises(ValueError, match="made for 1..50"):
        floor.at(51)


def test_step_times_record_each_decoding_steps_shape_and_time(tiny):
    """The prefill step is left out: AR's decoding steps are 1 row each, whatever the prompt length;
    a drafter's steps are recorded with their own row counts, which add up to its decoding rows, and
    their times (and the drafter's) to the decode's after its first step."""
    model, _ = tiny
    prompt = list(range(10, 30)) * 2
    ar = decode(Target(model), Drafter(), prompt, 12)
    assert ar.prefill_tokens >= len(prompt) and top_shapes(ar) == {(1, 0): ar.target_calls - 1}
    pld = decode(Target(model), PLDDrafter(PLDConfig(draft_len=4, ngram_max=2)), prompt, 12)
    shapes = top_shapes(pld, most=100)
    assert len(shapes) > 1  # the repeated prompt: some steps draft, some do not
    assert len(pld.step_times) == sum(shapes.values()) == pld.target_calls - 1
    assert sum(rows for rows, _, _, _ in pld.step_times) == pld.forward_tokens - pld.prefill_tokens
    steps = sum(s for _, _, s, _ in pld.step_times)
    assert 0.9 * steps < pld.seconds - pld.prefill_seconds and steps <= pld.seconds - pld.prefill_seconds
    assert sum(d for _, _, _, d in pld.step_times) == pytest.approx(pld.draft_seconds - pld.prefill_draft_seconds)
    empty = DecodeResult(tokens=[1], target_calls=1, forward_tokens=20, prefill_tokens=20)
    assert top_shapes(empty) == {} and decode_floors(RowsFloor(Target(model), cache_len=30), empty, 10) is None


def test_the_floor_of_a_row_mix_weights_each_shapes_forward_by_its_steps(tiny, monkeypatch):
    model, _ = tiny
    floor = RowsFloor(Target(model), cache_len=30)
    monkeypatch.setattr(floor, "ms", lambda rows, gated=0, before=None: 10.0 * rows + gated)  # a known forward time
    assert floor.mix({(1, 0): 3, (4, 1): 1}) == pytest.approx((3 * 10 + 40) / 4)  # not the forward of 2 rows
    assert floor.mix({(1, 0): 3, (4, 1): 1}, gated=True) == pytest.approx((3 * 10 + 41) / 4)
    # beyond the `most` most frequent shapes the rare ones are left out
    steps = [(rows, 0, 0.01, 0.0) for rows, n in ((1, 5), (2, 4), (3, 3), (4, 2), (50, 1)) for _ in range(n)]
    shapes = top_shapes(DecodeResult(tokens=[], step_times=steps))
    assert shapes == {(1, 0): 5, (2, 0): 4, (3, 0): 3, (4, 0): 2}
    assert floor.mix(shapes) == pytest.approx((50 + 80 + 90 + 80) / 14)


def test_a_decodes_steps_are_taken_as_its_floor_is_the_median_of_each_shape():
    """A stall that lengthens a few steps moves each shape's mean, not its median: the steps are
    taken with the floor's statistic; without drafting, each step loses its drafter's time."""
    steps = [(1, 0, 0.010, 0.001)] * 8 + [(1, 0, 0.100, 0.001)] * 2 + [(3, 1, 0.012, 0.002)] * 5
    result = DecodeResult(tokens=[], step_times=steps)
    shapes = top_shapes(result)
    assert step_mix(result, shapes, drafting=True) == pytest.approx((10 * 10 + 5 * 12) / 15)
    assert step_mix(result, shapes) == pytest.approx((10 * 9 + 5 * 10) / 15)


def test_a_gated_floor_gates_the_extra_rows_as_a_step_gates_its_masks(tiny):
    """`own` forwards gate their last `extras` rows: the model's own work for a gated step (the
    adapter's), which `x_loop` takes out; the rows before them are the plain forward's."""
    from tests.models.test_gated_lora import make_gated
    from mtpkit.models.gated_lora.drafter import GatedLoRADraftConfig, GatedLoRADrafter

    model, _ = tiny
    assert not RowsFloor(Target(model), cache_len=30).own
    drafter = GatedLoRADrafter(GatedLoRADraftConfig(decoding="linear"), model=make_gated(model, k=3, rank=4, seed=5))
    target = Target(*drafter.adapt(None, {}))
    floor = RowsFloor(target, cache_len=30)
    assert floor.own
    out = {}
    head = target.lm_head
    target.lm_head = lambda hidden: out.setdefault(len(out), hidden.clone())
    floor.forward(4)
    floor.forward(4, gated=2)
    target.lm_head = head
    assert torch.equal(out[0][:2], out[1][:2]) and not torch.allclose(out[0][2:], out[1][2:])
    result = decode(target, drafter, list(range(10, 30)), 8)
    floors = decode_floors(floor, result, 20)
    assert floor.cache_len == 20 + len(result.tokens) // 2  # at the decode's mean cache length
    assert {extras for _, extras in top_shapes(result)} != {0}  # its steps gate mask rows
    assert set(floors) == {"rows", "own", "step", "loop"} and floors["loop"] <= floors["step"]


def test_a_drafters_draft_is_redone_before_each_of_its_own_floor_forwards(tiny_byte, monkeypatch):
    """A drafter with a draft to redo (MTPC) gets it redone, untimed, before every `own` floor
    forward (the caches its step's forward meets); one without (AR) gets its plain rows as `own`."""
    from tests.eval.test_mtpc_decoding import make_head
    from mtpkit.models.mtpc.drafter import MTPCDraftConfig, MTPCDrafter

    backbone, _ = tiny_byte
    target, prompt = Target(backbone), list(range(40, 60))
    drafter = MTPCDrafter(MTPCDraftConfig(), model=make_head(backbone, "btree", 0, n=4, seed=2))
    assert redoes_draft(drafter) and not redoes_draft(Drafter()) and not redoes_draft(None)
    result = decode(target, drafter, prompt, 24)
    events = []
    forward = RowsFloor.forward
    monkeypatch.setattr(RowsFloor, "forward",
                        lambda self, rows, gated=0: events.append("forward") or forward(self, rows, gated))
    monkeypatch.setattr(drafter, "redo_draft", lambda: events.append("redo"))
    floor = RowsFloor(target, cache_len=20, longest=60)
    floors = decode_floors(floor, result, len(prompt), drafter)
    redone = [i for i, e in enumerate(events) if e == "redo"]
    assert redone and all(events[i + 1] == "forward" for i in redone)
    assert len(redone) == 3 * len(top_shapes(result))  # each timed forward of each shape
    assert set(floors) == {"rows", "own", "step", "loop"}
    events.clear()
    ar = decode(target, Drafter(), prompt, 8)
    floors = decode_floors(floor, ar, len(prompt), Drafter())
    assert "redo" not in events and floors["own"] == floors["rows"]


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


def test_x_loop_takes_the_methods_own_work_out_of_x_rows():
    from types import SimpleNamespace

    from mtpkit.eval.bench_results import step_floors

    def floors(rows, own, step, loop):
        return {"rows": rows, "own": own, "step": step, "loop": loop}

    setup = SimpleNamespace(compile_s={}, targets={}, host_reads={},
                            floor_ms={"m": [floors(10, 11, 13, 11), floors(12, 12, 12, 12), floors(11, 11, 14, 12)],
                                      "ar": [floors(5, 5, 5.5, 5.5)]})
    results = {"methods": {"m": {"decode_step_ms": 13.0, "decode_draft_ms": 2.0}, "ar": {"decode_step_ms": 5.5}}}
    step_floors(results, setup, SimpleNamespace())
    m, ar = results["methods"]["m"], results["methods"]["ar"]
    # each decode's step over its own floor (1.3, 1.0, 1.27), then the median over decodes
    assert m["rows_ms"] == 11.0 and m["x_rows"] == round(14 / 11, 4)
    assert m["own_rows_ms"] == 11.0 and m["x_loop"] == 1.0  # 1.0, 1.0, 1.09
    assert ar["x_rows"] == 1.1 and "x_loop" not in ar  # no drafting time recorded: no claim about it
