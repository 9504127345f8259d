"""Train a small byte-level Llama from scratch: the embedded default backbone for MTPC ("Fast and
Expressive Multi-Byte Prediction with Probabilistic Circuits", arXiv:2511.11346, trains its heads
over a byte-level target; this one fits a CPU).

    python train/byte_lm.py --data runs/distilled.jsonl,builtin --output-dir runs/byte_lm
    python train/byte_lm.py --config configs/byte_lm/byte-llama-12m.yaml --time-budget-min 55

The corpus (data/bytes.py): chat records rendered with ChatML (self-distilled SmolLM2 answers
from data/distill.py, the built-in prompts), repeated `--chat-repeat` times, plus the Python
standard library's source for volume. Every 20th document of each source is held out.
Random blocks of `--block-size` bytes are drawn from the concatenated train stream (seeded by
the micro-step, so a resumed run draws the same blocks). The learning rate warms up, then
follows a cosine to `--min-lr-ratio` that ends at --max-steps or --time-budget-min, whichever
comes first.

Writes to --output-dir: config.yaml, metrics.jsonl (loss, bytes/s; held-out bits per byte
every --eval-every steps), metrics.png (the loss curve, at the end), checkpoint-N/
(train/checkpoints.py: state/, trainer_state.json, config.yaml and head/, the model as a Hugging
Face folder), and model/ (the final Hugging Face folder: config, safetensors, byte tokenizer) plus
eval.json with the final held-out bits per byte per source. `--install` also copies model/ to
the cache folder that the backbone name `mtpkit-byte-lm` loads (see models/backbone.py),
atomically: an interrupted install leaves the earlier installed model in place. One process is
the usual run; it also runs under `accelerate launch` or `torchrun` (DDP).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
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
from mtpkit.eval.report import write_training_plot
from mtpkit.models.backbone import BYTE_LM, byte_tokenizer, cache_dir
from mtpkit.models.atomic_write import write_atomic
from mtpkit.models.process import run_script
from mtpkit.train import engine, recipe_config
from mtpkit.train.checkpoints import save_checkpoint
from mtpkit.train.config import NOT_EMPTY, Rule, at_least, one_of
from mtpkit.train.recipe_config import TrainArgs


@dataclasses.dataclass
class ByteLMConfig(TrainArgs):
    output_dir: str = "runs/byte_lm"
    max_steps: int = 2000
    """optimizer steps (the run also stops at --time-budget-min)"""
    batch_size: int = 8
    lr: float = 2e-3
    warmup_steps: int = 50
    decay_steps: int = -1
    lr_decay: str = "cosine"
    weight_decay: float = 0.1
    """AdamW weight decay on matrices"""
    seed: int = 0
    """seed of the init and of the block sampling"""
    log_every: int = 10
    eval_every: int = 200
    save_every: int = 200
    data: list[str] = dataclasses.field(default_factory=lambda: ["builtin"])
    """chat sources, comma-separated: .jsonl of messages (data/distill.py output) or builtin"""
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
    time_budget_min: float = 0.0
    """stop, evaluate and save after this many minutes of training (0 = no limit); the lr decay ends there too"""
    eval_blocks: int = 16
    """held-out blocks per source per evaluation (also at the end, into eval.json)"""
    install: bool = False
    """copy the final model to the `mtpkit-byte-lm` backbone cache folder"""
    threads: int = 0
    """torch CPU threads (0 = torch's default)"""
    dtype: str = "auto"
    """auto | float32: byte_lm has no frozen backbone; every weight trains and stays float32 for
    the optimizer (--mixed-precision bf16 for bfloat16 matmuls)"""


RULES: tuple[Rule, ...] = (
    ("data", *NOT_EMPTY),
    ("stdlib_mb", *at_least(0)),
    ("chat_repeat", *at_least(1)),
    ("hidden_size", *at_least(1)),
    ("num_layers", *at_least(1)),
    ("num_heads", *at_least(1)),
    ("num_kv_heads", *at_least(1)),
    ("hidden_size", lambda v, cfg: v % cfg.num_heads == 0 and v // cfg.num_heads % 2 == 0,
     "--num-heads times an even head size (rotary embeddings)"),
    ("num_heads", lambda v, cfg: v % cfg.num_kv_heads == 0, "a multiple of --num-kv-heads"),
    ("intermediate_size", *at_least(1)),
    ("block_size", *at_least(1)),
    ("time_budget_min", *at_least(0)),
    ("eval_blocks", *at_least(1)),
    ("threads", *at_least(0)),
    ("dtype", *one_of(("auto", "float32", "fp32"))),
)
"""the recipe's own rules (after recipe_config.TRAIN_RULES)"""


def parse_args(argv=None) -> ByteLMConfig:
    p = recipe_config.argument_parser(ByteLMConfig, __doc__, "configs/byte_lm/*.yaml")
    return recipe_config.parse_config(p, ByteLMConfig, argv, RULES)


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
    """[B, block_size + 1] windows at seeded random offsets (a function of the step only: the
    global micro-step, times the processes, plus this process's rank)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(stream) - block_size - 1, (batch_size,), generator=g)
    return torch.stack([stream[s: s + block_size + 1] for s in starts.tolist()])


@torch.no_grad()
def bits_per_byte(model, stream: torch.Tensor, block_size: int, max_blocks: int) -> float:
    """Mean next-byte cross-entropy in bits over the first `max_blocks` consecutive blocks."""
    was_training = model.training
    model.eval()
    nats = count = 0.0
    device = next(model.parameters()).device
    for b in range(max_blocks):
        chunk = stream[b * block_size: (b + 1) * block_size + 1].to(device)
        if len(chunk) < 2:
            break
        logits = model(chunk[None, :-1]).logits[0]
        nats += float(F.cross_entropy(logits, chunk[1:], reduction="sum"))
        count += len(chunk) - 1
    model.train(was_training)
    return nats / max(count, 1) / math.log(2)


def install(folder: Path, target: Path) -> None:
    """Copy `folder` to `target`, never leaving `target` partial: the copy goes to a temporary
    folder beside it, then two renames swap it in (the old folder aside, the new one in its
    place), and the old one is deleted last."""
    target.parent.mkdir(parents=True, exist_ok=True)
    new, old = (target.with_name(f".{target.name}.{kind}-{os.getpid()}") for kind in ("new", "old"))
    shutil.rmtree(new, ignore_errors=True)
    try:
        shutil.copytree(folder, new)
        if target.exists():
            os.replace(target, old)
        os.replace(new, target)
    finally:
        shutil.rmtree(new, ignore_errors=True)
        if old.exists() and not target.exists():
            os.replace(old, target)  # the swap failed half-way: the earlier model goes back
    shutil.rmtree(old, ignore_errors=True)


def evaluate(model, corpus, cfg: ByteLMConfig) -> dict[str, float]:
    return {f"bpb/{name}": bits_per_byte(model, stream, cfg.block_size, cfg.eval_blocks)
            for name, stream in corpus.heldout.items()}


def main(argv=None) -> dict:
    cfg = parse_args(argv)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    accelerator = engine.setup(cfg, old_layout="retrain (its model.pt is a plain state dict of the same model)")
    if engine.zero_stage(accelerator) == 3:  # the evaluations and the final model/ read whole weights on one process
        sys.exit("byte_lm: DeepSpeed ZeRO-3 is not supported (its evaluations and the final model/ folder read the "
                 "whole model on the main process); use configs/accelerate/deepspeed_zero2.yaml or DDP")
    log = engine.printer(accelerator)
    tokenizer = byte_tokenizer()
    try:
        corpus = build_corpus(tokenizer, cfg.data, int(cfg.stdlib_mb * 1e6), chat_repeat=cfg.chat_repeat)
    except DataError as e:
        sys.exit(f"byte_lm: {e}")
    for line in corpus.report:
        log(f"[data] {line}")
    stream = torch.cat(list(corpus.train.values()))
    if len(stream) <= cfg.block_size + 1:
        sys.exit(f"byte_lm: the corpus has {len(stream)} bytes, fewer than one --block-size {cfg.block_size} block")
    lm = build_model(cfg, tokenizer)
    decay = [p for p in lm.parameters() if p.dim() >= 2]
    no_decay = [p for p in lm.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    log(f"[model] byte Llama {sum(p.numel() for p in lm.parameters()) / 1e6:.1f}M parameters, "
        f"{cfg.num_layers} layers x {cfg.hidden_size}; train stream {len(stream) / 1e6:.2f}M bytes "
        + ", ".join(f"{k} {len(v) / 1e6:.2f}M" for k, v in corpus.train.items()))
    budget, trained_seconds = cfg.time_budget_min * 60, 0.0  # the lr decay follows this clock when it is ahead
    model, optimizer, scheduler, state = engine.prepare(accelerator, cfg, lm, optimizer,
                                                        progress=lambda: trained_seconds / budget if budget else 0.0)
    step, micro, trained_seconds = state["step"], state["micro_step"], state.get("trained_seconds", 0.0)
    backward_step = engine.BackwardStep(accelerator, cfg, model.parameters(), optimizer, scheduler)

    def write_head(folder, state_dict=None):  # a Hugging Face folder, as model/ at the end
        lm.save_pretrained(folder, state_dict=state_dict)
        tokenizer.save_pretrained(folder)

    metrics, window = engine.MetricsWriter(accelerator, cfg), engine.Window(accelerator)
    bar = tqdm(total=cfg.max_steps, initial=step, desc="byte-lm", unit="step", disable=not accelerator.is_main_process)
    model.train()
    while step < cfg.max_steps:
        t0 = time.perf_counter()
        blocks = sample_blocks(stream, micro * accelerator.num_processes + accelerator.process_index,
                               cfg.batch_size, cfg.block_size, cfg.seed).to(accelerator.device)
        with accelerator.accumulate(model):
            logits = model(blocks[:, :-1]).logits
            loss = F.cross_entropy(logits.flatten(0, 1), blocks[:, 1:].flatten())
            skipped = backward_step(loss)
        micro += 1
        trained_seconds += time.perf_counter() - t0
        window.add(loss=loss)
        window.count(skipped_steps=skipped, bytes=blocks[:, 1:].numel())
        if not accelerator.sync_gradients:
            continue
        step += 1
        bar.update(1)
        # every process stops at the same step, the main process's clock deciding
        over_budget = budget and bool(accelerator.reduce(torch.tensor(
            [float(trained_seconds >= budget and accelerator.is_main_process)], device=accelerator.device)) > 0)
        last = step == cfg.max_steps or over_budget
        evaluate_now = bool(cfg.eval_every) and step % cfg.eval_every == 0 and not last
        if step % cfg.log_every == 0 or evaluate_now:
            means, totals, seconds = window.reduce()
            row = {"step": step, "loss": means["loss"], "bits_per_byte": means["loss"] / math.log(2),
                   "lr": scheduler.get_last_lr()[0], "bytes_per_s": totals["bytes"] / seconds,
                   "trained_minutes": trained_seconds / 60, "skipped_steps": int(totals["skipped_steps"])}
            if evaluate_now and accelerator.is_main_process:  # the others wait at the barrier
                row.update(evaluate(lm, corpus, cfg))
            metrics.write(row)
            bar.set_postfix(bpb=f"{row['bits_per_byte']:.2f}")
            accelerator.wait_for_everyone()
        if step % cfg.save_every == 0 or last:
            save_checkpoint(accelerator, model, optimizer, cfg, step,
                            {"micro_step": micro, "trained_seconds": trained_seconds}, write_head)
        if over_budget:
            log(f"[budget] {cfg.time_budget_min} min of training reached at step {step}")
            break
    bar.close()

    result = {}
    if accelerator.is_main_process:
        result = {"step": step, "trained_minutes": trained_seconds / 60, **evaluate(lm, corpus, cfg),
                  "parameters": sum(p.numel() for p in lm.parameters())}
        folder = Path(cfg.output_dir) / "model"
        write_head(folder)
        write_atomic(folder.parent / "eval.json", json.dumps(result, indent=2))
        metrics.write(result)
        write_training_plot(metrics.path, Path(cfg.output_dir) / "metrics.png")
        log("[eval] held-out bits per byte: " + ", ".join(
            f"{k.split('/', 1)[1]} {v:.3f}" for k, v in result.items() if k.startswith("bpb/")))
        if cfg.install:
            target = cache_dir() / BYTE_LM
            install(folder, target)
            log(f"[install] {folder} -> {target} (backbone name {BYTE_LM!r})")
    del model  # see engine.finish
    engine.finish(accelerator)
    return result


if __name__ == "__main__":
    run_script(main)
