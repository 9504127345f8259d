"""Train a small byte-level Llama from scratch: the embedded default backbone for MTPC (seed 003).

    python train/byte_lm.py --data runs/distilled.jsonl,builtin --output-dir runs/byte_lm
    python train/byte_lm.py --config configs/byte_lm/byte-llama-12m.yaml --time-budget-min 55

The corpus (data/bytes.py): chat records rendered with ChatML (self-distilled SmolLM2 answers
from data/distill.py, the built-in prompts), repeated `--chat-repeat` times, plus the Python
standard library's source for volume. Every 20th document of each source is held out.
Random blocks of `--block-size` bytes are drawn from the concatenated train stream (seeded by
the step, so a resumed run draws the same blocks). The learning rate warms up, then follows a
cosine to `--min-lr-ratio`.

Writes to --output-dir: config.yaml, metrics.jsonl (loss, bytes/s; held-out bits per byte
every --eval-every steps), checkpoint-N/ (weights, optimizer, trainer_state.json,
config.yaml), and model/ (a Hugging Face folder: config, safetensors, byte tokenizer) plus
eval.json with the final held-out bits per byte per source. `--install` also copies model/ to
the cache folder that the backbone name `mtpkit-byte-lm` loads (see models/backbone.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

from mtpkit.data.bytes import build_corpus
from mtpkit.data.chat import DataError
from mtpkit.models.backbone import BYTE_LM, byte_tokenizer, cache_dir
from mtpkit.train.checkpoints import prune_checkpoints, resume_folder, supersede_metrics
from mtpkit.train.config import ConfigError, add_config_args, resolve, to_yaml


@dataclasses.dataclass
class ByteLMConfig:
    data: list[str] = dataclasses.field(default_factory=lambda: ["builtin"])
    """chat sources, comma-separated: .jsonl of messages (data/distill.py output) or builtin"""
    output_dir: str = "runs/byte_lm"
    """where config, metrics, checkpoints and the final model/ folder go"""
    stdlib_mb: float = 8.0
    """MB of Python standard-library source added for volume (0 = none)"""
    chat_repeat: int = 4
    """times the chat training stream is repeated in the mix"""
    hidden_size: int = 384
    """model width"""
    num_layers: int = 6
    """transformer layers"""
    num_heads: int = 6
    """attention heads"""
    num_kv_heads: int = 2
    """key/value heads (grouped-query attention)"""
    intermediate_size: int = 1024
    """MLP width"""
    block_size: int = 1024
    """bytes per training sequence (also the context the model is trained for)"""
    batch_size: int = 8
    """sequences per optimizer step"""
    max_steps: int = 2000
    """optimizer steps (the run also stops at --time-budget-min)"""
    time_budget_min: float = 0.0
    """stop, evaluate and save after this many minutes of training (0 = no limit)"""
    lr: float = 2e-3
    """peak AdamW learning rate"""
    warmup_steps: int = 50
    """linear warm-up steps"""
    min_lr_ratio: float = 0.1
    """final learning rate as a fraction of --lr (cosine decay over --max-steps or --time-budget-min, whichever is shorter)"""
    weight_decay: float = 0.1
    """AdamW weight decay on matrices"""
    max_grad_norm: float = 1.0
    """gradient clipping (0 = off)"""
    seed: int = 0
    """seed of the init and of the block sampling"""
    log_every: int = 10
    """steps between metric lines"""
    eval_every: int = 200
    """steps between held-out bits-per-byte evaluations (0 = only at the end)"""
    eval_blocks: int = 16
    """held-out blocks per source per evaluation"""
    save_every: int = 200
    """steps between checkpoints (the last step always saves)"""
    resume: str = ""
    """checkpoint folder to resume from, or `auto` for the newest in output_dir"""
    install: bool = False
    """copy the final model to the `mtpkit-byte-lm` backbone cache folder"""
    threads: int = 0
    """torch CPU threads (0 = torch's default)"""


def parse_args(argv=None) -> ByteLMConfig:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML config (configs/byte_lm/*.yaml); flags override it")
    add_config_args(p, ByteLMConfig)
    args = p.parse_args(argv)
    try:
        cfg = resolve(ByteLMConfig, args)
    except ConfigError as e:
        p.error(str(e))
    if min(cfg.max_steps, cfg.batch_size, cfg.block_size, cfg.num_layers, cfg.chat_repeat) < 1:
        p.error("--max-steps, --batch-size, --block-size, --num-layers and --chat-repeat must be >= 1")
    if cfg.hidden_size % cfg.num_heads or cfg.num_heads % cfg.num_kv_heads:
        p.error("--hidden-size must divide by --num-heads, and --num-heads by --num-kv-heads")
    return cfg


def build_model(cfg: ByteLMConfig, tokenizer) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=max(4096, cfg.block_size), rope_theta=10000.0, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(cfg.seed)
    return LlamaForCausalLM(config)


def sample_blocks(stream: torch.Tensor, step: int, batch_size: int, block_size: int, seed: int) -> torch.Tensor:
    """[B, block_size + 1] windows at seeded random offsets (a function of the step only)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(stream) - block_size - 1, (batch_size,), generator=g)
    return torch.stack([stream[s: s + block_size + 1] for s in starts.tolist()])


@torch.no_grad()
def bits_per_byte(model, stream: torch.Tensor, block_size: int, max_blocks: int) -> float:
    """Mean next-byte cross-entropy in bits over the first `max_blocks` consecutive blocks."""
    was_training = model.training
    model.eval()
    nats = count = 0.0
    for b in range(max_blocks):
        chunk = stream[b * block_size: (b + 1) * block_size + 1]
        if len(chunk) < 2:
            break
        logits = model(chunk[None, :-1]).logits[0]
        nats += float(F.cross_entropy(logits, chunk[1:], reduction="sum"))
        count += len(chunk) - 1
    model.train(was_training)
    return nats / max(count, 1) / math.log(2)


def lr_at(cfg: ByteLMConfig, step: int, trained_seconds: float = 0.0) -> float:
    """Warmup by steps, then cosine over whichever ends first: --max-steps or --time-budget-min."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    if cfg.time_budget_min:
        progress = max(progress, trained_seconds / (cfg.time_budget_min * 60))
    progress = min(1.0, progress)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def evaluate(model, corpus, cfg: ByteLMConfig) -> dict[str, float]:
    return {f"bpb/{name}": bits_per_byte(model, stream, cfg.block_size, cfg.eval_blocks)
            for name, stream in corpus.heldout.items()}


def main(argv=None) -> dict:
    cfg = parse_args(argv)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python"] + sys.argv)
    (out / "config.yaml").write_text(to_yaml(cfg, command))
    tokenizer = byte_tokenizer()
    try:
        corpus = build_corpus(tokenizer, cfg.data, int(cfg.stdlib_mb * 1e6), chat_repeat=cfg.chat_repeat)
    except DataError as e:
        sys.exit(f"byte_lm: {e}")
    for line in corpus.report:
        tqdm.write(f"[data] {line}")
    stream = torch.cat(list(corpus.train.values()))
    if len(stream) <= cfg.block_size + 1:
        sys.exit(f"byte_lm: the corpus has {len(stream)} bytes, fewer than one --block-size {cfg.block_size} block")
    model = build_model(cfg, tokenizer)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    tqdm.write(f"[model] byte Llama {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
               f"{cfg.num_layers} layers x {cfg.hidden_size}; train stream {len(stream) / 1e6:.2f}M bytes "
               + ", ".join(f"{k} {len(v) / 1e6:.2f}M" for k, v in corpus.train.items()))

    step, trained_seconds = 0, 0.0
    resume = resume_folder(cfg.resume, out)
    if resume is not None:
        if not (resume / "trainer_state.json").is_file():
            sys.exit(f"byte_lm: --resume {resume}: not a checkpoint (no trainer_state.json)")
        model.load_state_dict(torch.load(resume / "model.pt", weights_only=True))
        optimizer.load_state_dict(torch.load(resume / "optimizer.pt", weights_only=True))
        state = json.loads((resume / "trainer_state.json").read_text())
        step, trained_seconds = state["step"], state["trained_seconds"]
        tqdm.write(f"[resume] {resume} at step {step}")
        supersede_metrics(out / "metrics.jsonl", step, tqdm.write)

    metrics_file = out / "metrics.jsonl"
    bar = tqdm(total=cfg.max_steps, initial=step, desc="byte-lm", unit="step")
    model.train()
    window_t, window_loss, window_n = time.perf_counter(), 0.0, 0
    while step < cfg.max_steps:
        t0 = time.perf_counter()
        blocks = sample_blocks(stream, step, cfg.batch_size, cfg.block_size, cfg.seed)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(cfg, step, trained_seconds)
        logits = model(blocks[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1), blocks[:, 1:].flatten())
        loss.backward()
        if cfg.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        trained_seconds += time.perf_counter() - t0
        window_loss, window_n = window_loss + loss.item(), window_n + 1
        bar.update(1)
        over_budget = cfg.time_budget_min and trained_seconds >= cfg.time_budget_min * 60
        last = step == cfg.max_steps or over_budget
        evaluate_now = bool(cfg.eval_every) and step % cfg.eval_every == 0 and not last
        if step % cfg.log_every == 0 or evaluate_now:
            seconds = time.perf_counter() - window_t
            row = {"step": step, "loss": window_loss / window_n, "bits_per_byte": window_loss / window_n / math.log(2),
                   "lr": lr_at(cfg, step - 1, trained_seconds), "bytes_per_s": window_n * cfg.batch_size * cfg.block_size / seconds,
                   "trained_minutes": trained_seconds / 60}
            if evaluate_now:
                row.update(evaluate(model, corpus, cfg))
            with open(metrics_file, "a") as f:
                f.write(json.dumps(row) + "\n")
            bar.set_postfix(bpb=f"{row['bits_per_byte']:.2f}")
            window_t, window_loss, window_n = time.perf_counter(), 0.0, 0
        if step % cfg.save_every == 0 or last:
            ckpt = out / f"checkpoint-{step}"
            ckpt.mkdir(exist_ok=True)
            torch.save(model.state_dict(), ckpt / "model.pt")
            torch.save(optimizer.state_dict(), ckpt / "optimizer.pt")
            (ckpt / "config.yaml").write_text(to_yaml(cfg, command))
            (ckpt / "trainer_state.json").write_text(json.dumps({"step": step, "trained_seconds": trained_seconds}))
            prune_checkpoints(out, keep=2)
        if over_budget:
            tqdm.write(f"[budget] {cfg.time_budget_min} min of training reached at step {step}")
            break
    bar.close()

    result = {"step": step, "trained_minutes": trained_seconds / 60, **evaluate(model, corpus, cfg),
              "parameters": sum(p.numel() for p in model.parameters())}
    folder = out / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (out / "eval.json").write_text(json.dumps(result, indent=2))
    with open(metrics_file, "a") as f:
        f.write(json.dumps(result) + "\n")
    tqdm.write("[eval] held-out bits per byte: " + ", ".join(
        f"{k.split('/', 1)[1]} {v:.3f}" for k, v in result.items() if k.startswith("bpb/")))
    if cfg.install:
        target = cache_dir() / BYTE_LM
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(folder, target)
        tqdm.write(f"[install] {folder} -> {target} (backbone name {BYTE_LM!r})")
    return result


if __name__ == "__main__":
    main()
