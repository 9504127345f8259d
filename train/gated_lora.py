"""Train gated-LoRA mask-token MTP heads (seed 002) on self-distilled chat data.

    accelerate launch train/gated_lora.py --config configs/gated_lora/smollm2-135m_k4.yaml \
        --data runs/distilled.jsonl --output-dir runs/gated_lora/k4 --max-steps 600
    accelerate launch --config_file configs/accelerate/cpu_ddp.yaml train/gated_lora.py ...  # 2 CPU processes
    torchrun --nproc_per_node 2 train/gated_lora.py ...                     # the same, with torchrun
    accelerate launch --config_file configs/accelerate/deepspeed_zero2.yaml train/gated_lora.py ...
    python train/gated_lora.py ...                                          # one process

Every step: Figure-4 inputs (k masks after each loss-carrying token), one forward of the
frozen backbone with LoRA gated on at mask positions, base + sampler cross-entropy and the
latent-consistency loss, backward into LoRA, mask embeddings and sampler only.
Writes to --output-dir: config.yaml (resolved), metrics.jsonl (every --log-every steps, plus
`sim_tau` every --eval-every steps: acceptance length of real speculative decoding on held-out
prompts), metrics.png (the same as curves, at the end), checkpoint-N/ (accelerate state +
trainer_state.json + config.yaml + head/, the loadable head), tensorboard/ with --tensorboard 1. `--resume auto` continues from the newest
checkpoint with the same losses as an uninterrupted run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from mtpkit.data.chat import IGNORE, DataError, load_examples, prompt_ids, tokenize_chat
from mtpkit.data.mtp import collate_mask_inputs, mask_inputs
from mtpkit.eval.decoder import Target, decode
from mtpkit.eval.report import write_training_plot
from mtpkit.models.backbone import DEFAULT_BACKBONE, eos_token_ids, load_backbone
from mtpkit.models.gated_lora.drafter import DECODINGS, GatedLoRADraftConfig, GatedLoRADrafter
from mtpkit.models.gated_lora import GatedLoRAConfig, GatedMTP, save_head
from mtpkit.train.checkpoints import micro_batch, prune_checkpoints, resume_folder, supersede_metrics
from mtpkit.train.config import ConfigError, add_config_args, resolve, to_yaml


@dataclasses.dataclass
class TrainConfig:
    backbone: str = DEFAULT_BACKBONE
    """target model: a known name, a local HF folder or a Hub id"""
    data: str = "runs/distilled.jsonl"
    """training chat data (.jsonl of messages, e.g. data/distill.py output) or a `datasets` name"""
    eval_data: str = "builtin:eval"
    """prompts for the simulated tau; prompts that also occur in --data are left out"""
    output_dir: str = "runs/gated_lora"
    """where config, metrics, checkpoints and tensorboard logs go"""
    max_steps: int = 1000
    """optimizer steps"""
    batch_size: int = 1
    """sequences per process per micro-step"""
    grad_accum: int = 1
    """micro-steps per optimizer step"""
    lr: float = 2e-4
    """AdamW learning rate (flat after warm-up, as in the paper)"""
    warmup_steps: int = 0
    """linear warm-up steps"""
    decay_steps: int = 0
    """linear decay to --min-lr-ratio over the last N of --max-steps (warm-up, stable, decay); 0 = flat to the end"""
    min_lr_ratio: float = 0.1
    """final learning rate as a fraction of --lr when --decay-steps > 0"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping (0 = off)"""
    max_length: int = 384
    """tokens per sequence before the masks are inserted (longer conversations are cut)"""
    mixed_precision: str = "no"
    """no | bf16 | fp16 (autocast; the frozen backbone stays in --dtype)"""
    dtype: str = "float32"
    """backbone weight dtype"""
    seed: int = 0
    """seed of the init and the data order"""
    log_every: int = 1
    """steps between metric lines"""
    save_every: int = 100
    """steps between checkpoints (the last step always saves)"""
    keep_checkpoints: int = 2
    """newest checkpoints kept on disk"""
    eval_every: int = 100
    """steps between simulated-tau measurements (0 = off)"""
    eval_prompts: int = 4
    """held-out prompts per simulated-tau measurement"""
    eval_max_new_tokens: int = 48
    """tokens generated per simulated-tau prompt"""
    eval_decoding: str = "quadratic"
    """linear | quadratic decoding for the simulated tau"""
    tensorboard: bool = False
    """also log to tensorboard (output_dir/tensorboard)"""
    resume: str = ""
    """checkpoint folder to resume from, or `auto` for the newest in output_dir"""
    trust_remote_code: bool = False
    """allow custom model code"""
    model: GatedLoRAConfig = dataclasses.field(default_factory=GatedLoRAConfig)


def parse_args(argv=None) -> TrainConfig:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML config (configs/gated_lora/*.yaml); flags override it")
    add_config_args(p, TrainConfig)
    args = p.parse_args(argv)
    try:
        cfg = resolve(TrainConfig, args)
    except ConfigError as e:
        p.error(str(e))
    if cfg.eval_decoding not in DECODINGS:
        p.error(f"--eval-decoding must be one of {DECODINGS}, got {cfg.eval_decoding!r}")
    if cfg.mixed_precision not in ("no", "bf16", "fp16"):
        p.error(f"--mixed-precision must be no, bf16 or fp16, got {cfg.mixed_precision!r}")
    if not 0 <= cfg.decay_steps <= cfg.max_steps:
        p.error(f"--decay-steps must be in [0, --max-steps={cfg.max_steps}], got {cfg.decay_steps}")
    if not 0.0 <= cfg.min_lr_ratio <= 1.0:
        p.error(f"--min-lr-ratio must be in [0, 1], got {cfg.min_lr_ratio}")
    if min(cfg.max_steps, cfg.batch_size, cfg.grad_accum, cfg.max_length, cfg.model.k) < 1:
        p.error("--max-steps, --batch-size, --grad-accum, --max-length and --k must be >= 1")
    return cfg


def lr_factor(cfg: TrainConfig, step: int) -> float:
    """Multiplier of --lr at optimizer step `step` (0-based): linear warm-up, flat, then an optional
    linear decay over the last --decay-steps. Only the step count is checkpointed, so a run resumed
    with a new --decay-steps or --max-steps follows the new schedule from where it stopped."""
    factor = min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0
    start = cfg.max_steps - cfg.decay_steps
    if cfg.decay_steps and step >= start:
        progress = min(1.0, (step - start + 1) / cfg.decay_steps)
        factor *= 1.0 - (1.0 - cfg.min_lr_ratio) * progress
    return factor


def build_features(cfg: TrainConfig, tokenizer, log) -> tuple[list[dict], set[str]]:
    """Tokenised training sequences (records without an assistant token to learn are counted),
    and the first message of every record (so the simulated tau can leave those prompts out)."""
    examples, report = load_examples(cfg.data)
    if report.skipped:
        log(f"[data] {report.summary()}")
    features, empty = [], 0
    for ex in examples:
        feat = tokenize_chat(tokenizer, ex.messages, max_length=cfg.max_length)
        labels = torch.tensor(feat["labels"])
        if not (labels != IGNORE).any():
            empty += 1
            continue
        features.append({"input_ids": torch.tensor(feat["input_ids"]), "labels": labels})
    if empty:
        log(f"[data] {cfg.data}: skipped {empty} record(s) with no assistant token within --max-length")
    if not features:
        raise DataError(f"{cfg.data}: no training sequence with an assistant answer")
    return features, {ex.messages[0]["content"] for ex in examples}


def eval_prompts(cfg: TrainConfig, tokenizer, train_examples_text: set[str]) -> list[list[int]]:
    examples, _ = load_examples(cfg.eval_data)
    by_category: dict[str, list] = {}
    for ex in examples:
        if ex.messages[0]["content"] not in train_examples_text:
            by_category.setdefault(ex.category, []).append(ex)
    # round-robin over categories, so a few prompts still cover code, math, chat, ...
    chosen = [ex for group in zip(*by_category.values()) for ex in group][: cfg.eval_prompts]
    return [prompt_ids(tokenizer, ex.messages) for ex in chosen]


@torch.no_grad()
def simulated_tau(mtp: GatedMTP, prompts: list[list[int]], cfg: TrainConfig, eos) -> float:
    """Mean acceptance length of greedy speculative decoding with the current head."""
    was_training = mtp.training
    drafter = GatedLoRADrafter(GatedLoRADraftConfig(decoding=cfg.eval_decoding, sampler=mtp.sampler is not None),
                               model=mtp)
    model, gate = drafter.adapt(None, {})
    target = Target(model, gate=gate)
    tokens = calls = 0
    for ids in prompts:
        res = decode(target, drafter, ids, cfg.eval_max_new_tokens, eos_token_ids=eos)
        tokens, calls = tokens + len(res.tokens), calls + res.target_calls
    mtp.train(was_training)
    return tokens / max(calls, 1)


def main(argv=None) -> dict:
    cfg = parse_args(argv)
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs, set_seed

    out = Path(cfg.output_dir)
    # Several processes without a GPU (torchrun, `accelerate launch --multi_gpu` or a config file):
    # accelerate would leave them unconnected (every process believing it is alone), so plain
    # DDP is told to use CPUs (gloo) and DeepSpeed gets gloo as its process-group backend.
    cpu_processes = int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.cuda.is_available()
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    accelerator = Accelerator(gradient_accumulation_steps=cfg.grad_accum, mixed_precision=cfg.mixed_precision,
                              log_with="tensorboard" if cfg.tensorboard else None, project_dir=str(out),
                              cpu=cpu_processes and not deepspeed,
                              kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")] if cpu_processes else [])
    main_process = accelerator.is_main_process
    log = (lambda msg: tqdm.write(msg)) if main_process else (lambda msg: None)
    set_seed(cfg.seed)
    command = " ".join(["accelerate launch" if accelerator.num_processes > 1 else "python"] + sys.argv)
    if main_process:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(to_yaml(cfg, command))
    if cfg.tensorboard:
        accelerator.init_trackers("tensorboard", config=_flat(dataclasses.asdict(cfg)))

    base, tokenizer = load_backbone(cfg.backbone, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code)
    eos = eos_token_ids(base, tokenizer)
    try:
        features, train_text = build_features(cfg, tokenizer, log)
        prompts = eval_prompts(cfg, tokenizer, train_text) if cfg.eval_every else []
    except DataError as e:
        sys.exit(f"gated_lora: {e}")
    mtp = GatedMTP(base, cfg.model, seed=cfg.seed)
    trainable = [p for p in mtp.parameters() if p.requires_grad]
    log(f"[model] {cfg.backbone}: k={cfg.model.k}, LoRA r={cfg.model.rank} on {len(cfg.model.target_modules)} "
        f"module kinds, {sum(p.numel() for p in trainable) / 1e6:.2f}M trainable of "
        f"{sum(p.numel() for p in mtp.parameters()) / 1e6:.1f}M; {len(features)} training sequences; "
        f"{accelerator.num_processes} process(es), {accelerator.distributed_type.value}")
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(cfg, s))
    if accelerator.state.deepspeed_plugin is not None:
        ds = accelerator.state.deepspeed_plugin.deepspeed_config
        ds["train_micro_batch_size_per_gpu"] = cfg.batch_size
        ds["gradient_accumulation_steps"] = cfg.grad_accum
        ds["train_batch_size"] = cfg.batch_size * cfg.grad_accum * accelerator.num_processes
        log(f"[deepspeed] ZeRO stage {ds.get('zero_optimization', {}).get('stage')} on {accelerator.num_processes} "
            f"process(es)")
    mtp, optimizer = accelerator.prepare(mtp, optimizer)
    # the schedule counts optimizer steps; a prepared scheduler would advance num_processes times
    # per step (accelerate's convention), so it is stepped here and only checkpointed by accelerate
    accelerator.register_for_checkpointing(scheduler)

    step, micro, tokens_seen = 0, 0, 0
    resume = resume_folder(cfg.resume, out)
    if resume is not None:
        if not (resume / "trainer_state.json").is_file():
            sys.exit(f"gated_lora: --resume {resume}: not a checkpoint (no trainer_state.json)")
        accelerator.load_state(str(resume / "state"))
        state = json.loads((resume / "trainer_state.json").read_text())
        step, micro, tokens_seen = state["step"], state["micro_step"], state["tokens_seen"]
        log(f"[resume] {resume} at step {step}")
        if main_process:
            supersede_metrics(out / "metrics.jsonl", step, log)

    metrics_file = out / "metrics.jsonl"
    bar = tqdm(total=cfg.max_steps, initial=step, desc="gated-lora", unit="step", disable=not main_process)
    window = {"t": time.perf_counter(), "slots": 0, "ntp": 0, "sums": {}, "n": 0}
    result = {}
    mtp.train()
    while step < cfg.max_steps:
        feats = micro_batch(features, micro, accelerator.process_index, accelerator.num_processes, cfg.batch_size,
                            cfg.seed)
        slots = [mask_inputs(f["input_ids"], f["labels"], cfg.model.k) for f in feats]
        batch = collate_mask_inputs(slots)
        batch = {k: v.to(accelerator.device) for k, v in batch.items()}
        with accelerator.accumulate(mtp):
            losses = mtp(**batch)
            accelerator.backward(losses["loss"])
            if accelerator.sync_gradients and cfg.max_grad_norm > 0:
                accelerator.clip_grad_norm_(trainable, cfg.max_grad_norm)
            optimizer.step()
            if accelerator.sync_gradients:
                scheduler.step()
            optimizer.zero_grad()
        micro += 1
        window["slots"] += sum(s["input_ids"].numel() for s in slots)  # NTP + mask positions
        window["ntp"] += sum(f["input_ids"].numel() for f in feats)
        for key, value in losses.items():
            if not torch.isnan(value):
                window["sums"][key] = window["sums"].get(key, 0.0) + float(value.detach())
        window["n"] += 1
        if not accelerator.sync_gradients:
            continue
        step += 1
        bar.update(1)
        if step % cfg.log_every == 0 or step == cfg.max_steps:
            seconds = time.perf_counter() - window["t"]
            totals = accelerator.reduce(torch.tensor([window["slots"], window["ntp"]], dtype=torch.float64,
                                                     device=accelerator.device), reduction="sum")
            means = {k: v / window["n"] for k, v in window["sums"].items()}
            means = {k: float(v) for k, v in zip(means, accelerator.reduce(
                torch.tensor(list(means.values()), device=accelerator.device), reduction="mean"))}
            tokens_seen += int(totals[1])
            result = {"step": step, **means, "lr": scheduler.get_last_lr()[0],
                      "slots_per_s": float(totals[0]) / seconds, "ntp_tokens_per_s": float(totals[1]) / seconds,
                      "tokens_seen": tokens_seen}
            if main_process:
                with open(metrics_file, "a") as f:
                    f.write(json.dumps(result) + "\n")
                bar.set_postfix(loss=f"{means['loss']:.3f}", mtp=f"{means.get('base_mtp', math.nan):.2f}",
                                acc1=f"{means.get('acc_m1', math.nan):.2f}")
                if cfg.tensorboard:
                    accelerator.log(result, step=step)
            window = {"t": time.perf_counter(), "slots": 0, "ntp": 0, "sums": {}, "n": 0}
        if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.max_steps) and prompts:
            if main_process:
                t0 = time.perf_counter()
                tau = simulated_tau(accelerator.unwrap_model(mtp), prompts, cfg, eos)
                with open(metrics_file, "a") as f:
                    f.write(json.dumps({"step": step, "sim_tau": tau, "eval_seconds": time.perf_counter() - t0}) + "\n")
                log(f"[eval] step {step}: simulated tau {tau:.3f} ({cfg.eval_decoding}, {len(prompts)} prompts)")
                result["sim_tau"] = tau
                window["t"] = time.perf_counter()  # evaluation time is not training throughput
            accelerator.wait_for_everyone()
        if step % cfg.save_every == 0 or step == cfg.max_steps:
            save_checkpoint(accelerator, mtp, cfg, out / f"checkpoint-{step}", step, micro, tokens_seen, command)
    bar.close()
    if main_process and metrics_file.is_file():
        write_training_plot(metrics_file, out / "metrics.png")
    accelerator.end_training()
    return result


def save_checkpoint(accelerator, mtp, cfg: TrainConfig, ckpt: Path, step: int, micro: int, tokens_seen: int,
                    command: str) -> None:
    """accelerate state (model, optimizer, scheduler, RNG; DeepSpeed-aware) + the loadable head."""
    accelerator.wait_for_everyone()
    accelerator.save_state(str(ckpt / "state"))
    state = accelerator.get_state_dict(mtp)  # gathers ZeRO-3 shards; full tensors on the main process
    if accelerator.is_main_process:
        save_head(accelerator.unwrap_model(mtp), ckpt / "head", cfg.backbone, state_dict=state)
        (ckpt / "config.yaml").write_text(to_yaml(cfg, command))
        (ckpt / "trainer_state.json").write_text(json.dumps({"step": step, "micro_step": micro,
                                                             "tokens_seen": tokens_seen}))
        prune_checkpoints(ckpt.parent, cfg.keep_checkpoints)
    accelerator.wait_for_everyone()


def _flat(d: dict, prefix="") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return out


if __name__ == "__main__":
    main()
