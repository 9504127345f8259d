"""Chat data through a slow byte tokenizer, as EvaByte ships one (a `PreTrainedTokenizer`, which
transformers 4.x refuses `return_offsets_mapping=True` and 5.x ignores): tokenize_chat labels exactly the bytes the
offsets of a fast byte tokenizer label, and refuses a tokenizer it cannot locate spans with."""

import pytest
from transformers import PreTrainedTokenizer

from mtpkit.data.chat import IGNORE, tokenize_chat
from mtpkit.models.backbone import byte_tokenizer

FAST = byte_tokenizer()
SPECIALS = [t for t in FAST.all_special_tokens if t not in ("",)]


class SlowBytes(PreTrainedTokenizer):
    """A slow byte tokenizer of the fast one's ids: byte b is id b, the specials whole."""

    def __init__(self, **kwargs):
        self._specials = {t: FAST.convert_tokens_to_ids(t) for t in SPECIALS}
        super().__init__(**kwargs)
        self.add_special_tokens({"additional_special_tokens": SPECIALS})
        self.chat_template = FAST.chat_template

    @property
    def vocab_size(self):
        return len(FAST)

    def get_vocab(self):
        return {**{f"<0x{b:02X}>": b for b in range(256)}, **self._specials}

    def _tokenize(self, text):
        return [f"<0x{b:02X}>" for b in text.encode()]

    def _convert_token_to_id(self, token):
        return self._specials[token] if token in self._specials else int(token[3:5], 16)

    def _convert_id_to_token(self, index):
        return next((t for t, i in self._specials.items() if i == index), f"<0x{index:02X}>")

    def convert_tokens_to_string(self, tokens):
        return b"".join(bytes([int(t[3:5], 16)]) if t not in self._specials else t.encode() for t in tokens).decode()


class MergingSlow(SlowBytes):
    """Encodes a newline followed by 'h' as one byte '~': a prefix ending in the newline does not
    encode to a prefix of the whole."""

    def _tokenize(self, text):
        return super()._tokenize(text.replace("\nh", "~"))


CHATS = [
    [{"role": "user", "content": "Add 3 and 4."}, {"role": "assistant", "content": "3 + 4 = 7."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Grüße? ✓"},
     {"role": "assistant", "content": "Hallo — ✓ 日本"}, {"role": "user", "content": "again"},
     {"role": "assistant", "content": "  indented\n\tcode\n"}],
]


def test_the_slow_tokenizer_refuses_offsets_and_encodes_as_the_fast_one():
    slow = SlowBytes()
    text = FAST.apply_chat_template(CHATS[1], tokenize=False)
    assert slow(text, add_special_tokens=False)["input_ids"] == FAST(text, add_special_tokens=False)["input_ids"]
    try:  # transformers 4.x raises NotImplementedError; 5.x returns no offsets
        assert "offset_mapping" not in slow(text, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError:
        pass


@pytest.mark.parametrize("chat", CHATS)
def test_labels_equal_the_offsets_of_a_fast_byte_tokenizer(chat):
    fast, slow = tokenize_chat(FAST, chat), tokenize_chat(SlowBytes(), chat)
    assert slow == fast
    assert any(label != IGNORE for label in slow["labels"]) and IGNORE in slow["labels"]
    answer = bytes(t for t, l in zip(fast["input_ids"], fast["labels"]) if l != IGNORE and t < 256).decode()
    assert all(m["content"].strip() in answer for m in chat if m["role"] == "assistant")


def test_a_tokenizer_without_offsets_or_prefix_encoding_is_refused():
    with pytest.raises(ValueError, match="prefix by prefix"):
        tokenize_chat(MergingSlow(), [{"role": "user", "content": "hey"}, {"role": "assistant", "content": "hello"}])
