"""The Figure-4 mask-token construction against a slot-by-slot brute-force reference."""

import torch

from mtpkit.data.chat import IGNORE
from mtpkit.data.mtp import allowed_attention, collate_mask_inputs, mask_inputs


def reference(ids: list[int], labels: list[int], k: int):
    """Build the slots one by one from the paper's description (Sec. 2.1, Figure 4)."""
    slots = []  # dicts: kind, pos, token, label, anchor, i
    for t, (x, y) in enumerate(zip(ids, labels)):
        slots.append(dict(kind="ntp", pos=t, token=x, label=y, anchor=t, i=0))
        if y == IGNORE:  # no masks after tokens that carry no loss (the prompt)
            continue
        for i in range(1, k + 1):
            label = labels[t + i] if t + i < len(ids) else IGNORE  # = x[t+1+i]
            slots.append(dict(kind="mask", pos=t + i, token=0, label=label, anchor=t, i=i))
    T = len(slots)
    allowed = torch.zeros(T, T, dtype=torch.bool)
    for q, a in enumerate(slots):
        for kv, b in enumerate(slots):
            if a["kind"] == "ntp":
                ok = b["kind"] == "ntp" and b["pos"] <= a["pos"]
            elif b["kind"] == "ntp":
                ok = b["pos"] <= a["anchor"]
            else:
                ok = b["anchor"] == a["anchor"] and b["i"] <= a["i"]
            allowed[q, kv] = ok
    return slots, allowed


def test_mask_inputs_match_brute_force():
    ids = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    # prompt of 3 tokens, answer to the end (labels in the Hugging Face convention: on the answer
    # tokens themselves); shifted, positions 0-1 carry no loss, position 2 predicts the first answer
    # token and the last position has nothing to predict
    token_labels = [IGNORE] * 3 + ids[3:]
    labels = [IGNORE, IGNORE] + ids[3:] + [IGNORE]
    for k in (1, 2, 3):
        slots, allowed = reference(ids, labels, k)
        got = mask_inputs(torch.tensor(ids), torch.tensor(token_labels), k)
        assert got["input_ids"].tolist() == [s["token"] for s in slots]
        assert got["mask_index"].tolist() == [s["i"] for s in slots]
        assert got["position_ids"].tolist() == [s["pos"] for s in slots]
        assert got["labels"].tolist() == [s["label"] for s in slots]
        assert torch.equal(allowed_attention(got), allowed)
        # sampler input: the token right before each label; LCM anchor: the NTP slot at that position
        ntp_slot = {s["pos"]: j for j, s in enumerate(slots) if s["kind"] == "ntp"}
        for j, s in enumerate(slots):
            if s["label"] != IGNORE:
                assert got["prev_ids"][j] == ids[s["pos"]]
                assert got["ntp_slot"][j] == ntp_slot[s["pos"]]
                assert slots[ntp_slot[s["pos"]]]["label"] == s["label"]  # same token as its LCM anchor


def test_masks_only_after_loss_tokens_and_lengths():
    ids = torch.arange(20, 30)
    token_labels = torch.full((10,), IGNORE)
    token_labels[7:10] = ids[7:10]
    labels = torch.cat([token_labels[1:], torch.tensor([IGNORE])])
    got = mask_inputs(ids, token_labels, 4)
    assert got["input_ids"].numel() == 10 + 4 * 3
    assert (got["mask_index"] > 0).sum() == 12
    ntp = got["mask_index"] == 0
    assert got["input_ids"][ntp].tolist() == ids.tolist()
    assert got["labels"][ntp].tolist() == labels.tolist()


def test_labels_follow_tokenize_chat(tiny):
    """End to end from a chat: NTP slots predict the NEXT token, and only answer tokens."""
    from mtpkit.data.chat import tokenize_chat
    _, tokenizer = tiny
    feat = tokenize_chat(tokenizer, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello you"}])
    ids, token_labels = torch.tensor(feat["input_ids"]), torch.tensor(feat["labels"])
    got = mask_inputs(ids, token_labels, 2)
    ntp = got["mask_index"] == 0
    learned = got["labels"][ntp] != IGNORE
    first = int((token_labels != IGNORE).nonzero()[0])
    assert learned.nonzero()[0] == first - 1  # the last prompt token predicts the first answer token
    assert torch.equal(got["labels"][ntp][learned], ids[learned.nonzero().squeeze(1) + 1])
    assert (got["labels"][~ntp][got["labels"][~ntp] != IGNORE] == got["prev_ids"][~ntp][got["labels"][~ntp] != IGNORE]).sum() < learned.sum()


def test_collate_pads_without_empty_rows():
    a = mask_inputs(torch.arange(5), torch.tensor([IGNORE, IGNORE, 2, 3, 4]), 2)
    b = mask_inputs(torch.arange(3), torch.tensor([IGNORE, IGNORE, IGNORE]), 2)
    batch = collate_mask_inputs([a, b])
    T = a["input_ids"].numel()
    assert batch["attention_mask"].shape == (2, 1, T, T)
    visible = batch["attention_mask"][:, 0] == 0
    assert visible.any(-1).all()  # every row (padding included) sees something: no NaN in softmax
    assert (batch["labels"][1, 3:] == IGNORE).all()
    assert torch.equal(visible[0], allowed_attention(a))
