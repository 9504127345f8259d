"""eval/generate.py, the user's way to run a head: the reply streamed step by step is the whole
reply, greedy replies are the backbone's own greedy reply with drafts accepted, and bad input is
one line before the backbone loads."""

import copy
import json

import pytest
import torch

from mtpkit.eval import generate as gen
from mtpkit.models.decoding.decoder import Target, decode
from mtpkit.models.backbone import eos_token_ids
from mtpkit.models.decoding.drafter import Draft, Drafter
from mtpkit.models.gated_lora import GatedLoRAConfig, GatedMTP, save_head
from mtpkit.models.generate import generate as plain_ar

PROMPT = "Repeat after me: the cat sat on the mat, the cat sat on the mat, the cat sat on the mat."


def ar_reply(model, tokenizer, prompt, n):
    ids = gen.generation_prompt_ids(tokenizer, [{"role": "user", "content": prompt}])
    eos = eos_token_ids(model, tokenizer)
    return plain_ar(model, [ids], n, eos, tokenizer.pad_token_id)[0]


class Chain(Drafter):
    """Proposes the next 3 tokens of a known reply as a chain, the third one wrong every other
    step: drafts accepted, and rejected."""

    def __init__(self, reference: list[int]):
        self.reference = reference

    def begin(self, target, prompt_ids):
        self.start, self.steps = len(prompt_ids), 0

    def propose(self, tokens):
        self.steps += 1
        draft = list(self.reference[len(tokens) - self.start:][:3])
        if len(draft) == 3 and self.steps % 2:
            draft[2] = (draft[2] + 1) % 50
        return Draft(tokens=torch.tensor(draft, dtype=torch.long), parents=torch.arange(len(draft)))


def test_the_streamed_reply_is_the_greedy_reply_with_drafts_accepted(tiny):
    model, tokenizer = tiny
    reference = ar_reply(model, tokenizer, PROMPT, 40)
    runner = gen.Runner(copy.deepcopy(model), tokenizer, "ar", drafter=Chain(reference))
    pieces = []
    reply = runner.generate(prompt=PROMPT, max_new_tokens=40, on_text=pieces.append)
    assert reply.tokens == reference
    assert reply.tau > 2  # the chain's drafts were accepted
    assert len(pieces) > 1 and "".join(pieces) == reply.text
    assert reply.text == tokenizer.decode(reply.tokens, skip_special_tokens=True)


@pytest.mark.parametrize("chain, n", [(False, 7), (True, 13)])
def test_on_tokens_gets_every_kept_token_once(tiny, chain, n):
    model, tokenizer = tiny
    ids = gen.generation_prompt_ids(tokenizer, [{"role": "user", "content": PROMPT}])
    drafter = Chain(ar_reply(model, tokenizer, PROMPT, n + 3)) if chain else Drafter()
    got = []
    result = decode(Target(model), drafter, ids, n, on_tokens=got.extend)
    assert got == result.tokens and len(got) == n
    eos = {result.tokens[4]}  # an EOS inside a step's tokens: the stream stops at it too
    got.clear()
    result = decode(Target(model), drafter, ids, n, eos_token_ids=eos, on_tokens=got.extend)
    assert got == result.tokens and got[-1] in eos
    assert not chain or result.target_calls < len(got)  # the chain: steps of several tokens


def test_sampling_runs_through_the_runner(tiny):
    model, tokenizer = tiny
    reply = gen.generate(copy.deepcopy(model), tokenizer, "pld", prompt=PROMPT, max_new_tokens=12,
                         temperature=0.7, seed=3)
    assert 0 < len(reply.tokens) <= 12 and reply.result.target_calls >= 1


def test_the_cli_runs_a_head_folder(tiny, tmp_path, capsys):
    model, tokenizer = tiny
    head = tmp_path / "head"
    save_head(GatedMTP(copy.deepcopy(model), GatedLoRAConfig(k=2, rank=4)), head, "tiny-llama-random")
    reply = gen.main(["--backbone", "tiny-llama-random", "--head", str(head), "--prompt", PROMPT,
                      "--max-new-tokens", "16", "--linear", "stock"])
    out, err = capsys.readouterr()
    assert out == reply.text + "\n"
    assert reply.tokens == ar_reply(model, tokenizer, PROMPT, 16)  # the gate leaves the target's outputs as they are
    assert f"[generate] gated_lora:head={head}: {len(reply.tokens)} tokens, tau" in err


def test_a_chat_file_is_read_in_any_record_format(tmp_path):
    path = tmp_path / "chat.json"
    path.write_text(json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}))
    assert gen.read_chat(str(path)) == [{"role": "user", "content": "hi"}]
    path.write_text(json.dumps([{"role": "user", "content": "hi"}]))
    assert gen.read_chat(str(path)) == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("argv, message", [
    (["--head", "no/such/folder", "--prompt", "x"], "no such folder"),
    (["--method", "hf_ar", "--prompt", "x"], "not a method of the mtpkit decoder"),
    (["--method", "probe:bc=x", "--prompt", "x"], "option bc needs a int"),
    (["--method", "ar", "--chat", "CHAT"], "--chat"),
])
def test_bad_input_is_one_line_before_the_backbone_loads(tmp_path, monkeypatch, argv, message):
    def refuse(*a, **k):
        raise AssertionError("the backbone loaded before the input was checked")
    monkeypatch.setattr(gen, "load_backbone", refuse)
    (tmp_path / "chat.json").write_text("[{")
    argv = [str(tmp_path / "chat.json") if a == "CHAT" else a for a in argv]
    with pytest.raises(SystemExit) as e:
        gen.main(["--backbone", "tiny-llama-random", *argv])
    text = str(e.value.code)
    assert text.startswith("generate: ") and message in text and "\n" not in text, text


class Bytes:
    """A tokenizer whose ids are bytes: one id may end in half a UTF-8 character."""

    @staticmethod
    def decode(ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_the_stream_holds_back_half_a_character():
    shown = []
    stream = gen.TextStream(Bytes(), shown.append)
    data = "né".encode()  # n, then é as two bytes
    stream([data[0], data[1]])
    assert shown == ["n"]
    stream([data[2]])
    assert shown == ["n", "é"]


def test_help_explains_every_flag(capsys):
    with pytest.raises(SystemExit):
        gen.parse_args(["--help"])
    text = capsys.readouterr().out
    for flag in ("--backbone", "--head", "--method", "--prompt", "--chat", "--max-new-tokens", "--temperature",
                 "--top-p", "--seed", "--linear", "--trust-remote-code", "--device", "--dtype"):
        assert flag in text
