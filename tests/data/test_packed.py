"""Packed MTPC batches (data/packed.py): every byte belongs to one example, no window crosses an
example's end, and encoding a packed row never lets one example attend to another (on the real
EvaByte architecture, whose EVA attention takes no document mask, and on a byte Llama)."""

import torch

from mtpkit.data.chat import IGNORE
from mtpkit.data.packed import pack_examples, pad_packed, segment_spans, window_targets_packed
from mtpkit.models.backbone import load_backbone
from mtpkit.models.mtpc import MTPCConfig, MTPCModel, window_targets


def examples(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, L in enumerate(lengths):
        ids = torch.randint(0, 256, (L,), generator=g)
        labels = ids.roll(-1).clone()
        labels[: L // 3] = IGNORE  # a prompt
        labels[-1] = IGNORE
        out.append({"input_ids": ids, "labels": labels, "tag": i})
    return out


def test_every_byte_belongs_to_one_example_and_long_ones_are_dropped():
    feats = examples([5, 30, 12, 64, 65, 7, 40, 3, 22, 100])
    packed, dropped = pack_examples(feats, 64, seed=1)
    assert dropped == 2  # 65 and 100 positions do not fit a 64-position sequence
    seen = []
    for seq in packed:
        assert len(seq["input_ids"]) <= 64
        spans = segment_spans(seq["segments"])
        assert spans[0][0] == 0 and spans[-1][1] == len(seq["input_ids"])
        for s, (a, b) in enumerate(spans):
            assert (seq["segments"][a:b] == s).all()
            match = [f for f in feats if len(f["input_ids"]) == b - a and torch.equal(f["input_ids"], seq["input_ids"][a:b])]
            assert len(match) == 1 and torch.equal(match[0]["labels"], seq["labels"][a:b])
            seen.append(match[0]["tag"])
    assert sorted(seen) == [0, 1, 2, 3, 5, 6, 7, 8]  # each kept example exactly once, whole


def test_no_window_crosses_an_example_end():
    feats = examples([9, 11, 6], seed=3)
    for f in feats:  # every byte an answer byte, as at the end of one chat and the start of a multi-turn one
        f["labels"] = f["input_ids"].roll(-1)
    packed, _ = pack_examples(feats, 64)
    ids, labels, segments = pad_packed(packed, 0)
    n = 4
    targets, valid = window_targets_packed(labels, segments, n)
    # the reference: each example's own windows, placed where the example sits
    for a, b in segment_spans(segments[0]):
        t_ref, v_ref = window_targets(labels[:, a:b], n)
        assert torch.equal(valid[:, a:b], v_ref) and torch.equal(targets[:, a:b][v_ref], t_ref[v_ref])
    # the unpacked rule would have let the last windows of an example read the next one
    plain = window_targets(labels, n)[1]
    assert (plain & ~valid).any()


def _attention_never_crosses(backbone, lora_layers):
    cfg = MTPCConfig(arch="btree", n=4, r=2, lora_layers=lora_layers)
    torch.manual_seed(0)
    model = MTPCModel(backbone, cfg).eval()
    if lora_layers:  # LoRA B starts at zero: make the draft layers differ from the backbone
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.5)
    feats = examples([20, 37, 11], seed=7)
    packed, _ = pack_examples(feats, 80)
    assert len(packed) == 1
    ids, _, segments = pad_packed(packed + [{"input_ids": torch.zeros(5, dtype=torch.long),
                                             "labels": torch.full((5,), IGNORE), "segments": torch.zeros(5, dtype=torch.long)}], 0)
    with torch.no_grad():
        e = model.features(ids, None, segments)  # [2, T, d]
        for a, b in segment_spans(segments[0]):
            alone = model.features(ids[:1, a:b])[0]
            torch.testing.assert_close(e[0, a:b], alone, atol=1e-5, rtol=0)
        assert (e[1, 5:] == 0).all()  # padding
        # changing the first example changes nothing of the others; one forward over the row would
        (a, b), rest = segment_spans(segments[0])[0], segment_spans(segments[0])[1:]
        other = ids.clone()
        other[0, a:b] = (other[0, a:b] + 1) % 256
        e2 = model.features(other, None, segments)
        assert not torch.allclose(e2[0, a:b], e[0, a:b])
        for s, t in rest:
            assert torch.equal(e2[0, s:t], e[0, s:t])
        joined = model.features(ids[:1, :rest[0][1]])[0]
        assert not torch.allclose(joined[rest[0][0]:rest[0][1]], e[0, rest[0][0]:rest[0][1]], atol=1e-3)


def test_attention_never_crosses_examples_on_the_real_evabyte():
    from tests.models.test_evabyte_real import build, tiny_config

    model = build(tiny_config(window=16, chunk=4))
    _attention_never_crosses(model, 0)
    _attention_never_crosses(model, 1)


def test_attention_never_crosses_examples_on_a_byte_llama():
    model, _ = load_backbone("tiny-byte-llama-random")
    _attention_never_crosses(model, 1)
