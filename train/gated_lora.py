"""Train gated-LoRA mask-token MTP heads on self-distilled chat data: the recipe of "Your LLM Knows
the Future: Uncovering Its Multi-Token Prediction Potential" (Samragh et al., arXiv:2507.11851).

    accelerate launch train/gated_lora.py --config configs/gated_lora/smollm2-135m_k4.yaml \
        --data runs/distilled.jsonl --output-dir runs/gated_lora/k4 --max-steps 600
    accelerate launch --config_file configs/accelerate/cpu_ddp.yaml train/gated_lora.py ...  # 2 CPU processes
    torchrun --nproc_per_node 2 train/gated_lora.py ...                     # the same, with torchrun
    accelerate launch --config_file configs/accelerate/deepspeed_zero2.yaml train/gated_lora.py ...
    python train/gated_lora.py ...                                          # one process

Every step: Figure-4 inputs (k masks after each loss-carrying token, or after a random
--anchors share of them), the frozen backbone with LoRA gated on at mask positions, base +
sampler cross-entropy and the latent-consistency loss (Eq. 1), backward into the LoRA and the
sampler (and the mask embeddings with --train-mask-embeds 1). With --cache-ntp 1 (gated LoRA) the
NTP tokens run once without gradient and the mask blocks attend to their cached keys/values:
the same losses, the backward over the mask slots only.
Writes to --output-dir: config.yaml (resolved), metrics.jsonl (every --log-every steps, plus
`sim_tau` every --eval-every steps: acceptance length of real speculative decoding on held-out
prompts), metrics.png (the same as curves, at the end), checkpoint-N/ (train/checkpoints.py:
state/, trainer_state.json, config.yaml and head/, the loadable head), tensorboard/ with
--tensorboard 1. `--resume auto` continues from the newest checkpoint with the same losses as an
uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from mtpkit.data.chat import IGNORE, DataError, load_examples, prompt_ids, tokenize_chat
from mtpkit.data.mtp import choose_anchors, collate_cached, collate_mask_inputs, mask_inputs
from mtpkit.models.decoding.decoder import Target, tokens_per_call
from mtpkit.eval.report import write_training_plot
from mtpkit.models.backbone import DTYPES, eos_token_ids, load_backbone
from mtpkit.models.gated_lora.drafter import DECODINGS, GatedLoRADraftConfig, GatedLoRADrafter
from mtpkit.models.gated_lora import GatedLoRAConfig, GatedMTP
from mtpkit.models.gated_lora.model import LCM_DISTANCES
from mtpkit.models.process import run_script
from mtpkit.models.registry import METHODS
from mtpkit.train import engine, recipe_config
from mtpkit.train.checkpoints import save_checkpoint
from mtpkit.train.config import NOT_EMPTY, Rule, above, at_least, one_of
from mtpkit.train.recipe_config import HeadTrainArgs


@dataclasses.dataclass
class TrainConfig(HeadTrainArgs):
    output_dir: str = "runs/gated_lora"
    lr: float = 2e-4
    """peak AdamW learning rate (flat after warm-up, as in the paper)"""
    eval_prompts: int = 4
    """held-out prompts per simulated-tau measurement (every --eval-every steps)"""
    eval_max_new_tokens: int = 48
    """tokens generated per simulated-tau prompt"""
    eval_decoding: str = "quadratic"
    """linear | quadratic decoding for the simulated tau"""
    anchors: float = 1.0
    """share of the loss-carrying positions that get a block of k masks each step, drawn at
    random per step (1 = every one, the paper's Figure 4); the sequence grows by k x anchors"""
    cache_ntp: bool = True
    """gated LoRA: run the NTP tokens once without gradient and the mask blocks over their
    cached keys/values (the same losses; the backward covers the mask slots only)"""
    model: GatedLoRAConfig = dataclasses.field(default_factory=GatedLoRAConfig)


RULES: tuple[Rule, ...] = recipe_config.HEAD_TRAIN_RULES + (
    # the float32 LoRA and sampler meet a float16 backbone's activations only under float16
    # autocast, which accelerate does not run on a CPU (MTPC's head casts its inputs itself)
    ("dtype", lambda v, cfg: DTYPES.get(v) != torch.float16 or not recipe_config.trains_on_cpu(cfg),
     "float32, bfloat16 or auto on a CPU (float16 trains on a GPU only)"),
    ("eval_prompts", *at_least(1)),
    ("eval_max_new_tokens", *at_least(1)),
    ("eval_decoding", *one_of(DECODINGS)),
    ("anchors", lambda v, cfg: 0 < v <= 1, "in (0, 1]"),
    ("lcm", *one_of(LCM_DISTANCES)),
    ("k", *at_least(1)),
    ("rank", *at_least(1)),
    ("alpha", *above(0)),
    ("dropout", lambda v, cfg: 0 <= v < 1, "in [0, 1)"),
    ("target_modules", *NOT_EMPTY),
    ("base_weight", *at_least(0)),
    ("sampler_weight", *at_least(0)),
    ("lcm_weight", *at_least(0)),
)
"""the recipe's own rules (after recipe_config.TRAIN_RULES)"""


def parse_args(argv=None) -> TrainConfig:
    p = recipe_config.argument_parser(TrainConfig, __doc__, "configs/gated_lora/*.yaml")
    return recipe_config.parse_config(p, TrainConfig, argv, RULES)


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
    drafter = GatedLoRADrafter(GatedLoRADraftConfig(decoding=cfg.eval_decoding), model=mtp)
    model, gate = drafter.adapt(None, {})
    target = Target(model, gate=gate)
    tau = tokens_per_call(target, drafter, prompts, cfg.eval_max_new_tokens, eos)
    mtp.train(was_training)
    return tau


def main(argv=None) -> dict:
    cfg = parse_args(argv)
    accelerator = engine.setup(cfg, old_layout="start a new run (its head/ folder still exports and decodes)")
    log = engine.printer(accelerator)

    base, tokenizer = load_backbone(cfg.backbone, dtype=engine.backbone_dtype(cfg, accelerator),
                                    trust_remote_code=cfg.trust_remote_code, device=accelerator.device)
    eos = eos_token_ids(base, tokenizer)
    try:
        features, train_text = build_features(cfg, tokenizer, log)
        prompts = eval_prompts(cfg, tokenizer, train_text) if cfg.eval_every else []
    except DataError as e:
        sys.exit(f"gated_lora: {e}")
    mtp = GatedMTP(base, cfg.model, seed=cfg.seed)
    trainable = engine.float32_trainable(p for p in mtp.parameters() if p.requires_grad)
    log(f"[model] {cfg.backbone}: k={cfg.model.k}, LoRA r={cfg.model.rank} on {len(cfg.model.target_modules)} "
        f"module kinds, {sum(p.numel() for p in trainable) / 1e6:.2f}M trainable of "
        f"{sum(p.numel() for p in mtp.parameters()) / 1e6:.1f}M; {len(features)} training sequences; "
        f"{accelerator.num_processes} process(es), {accelerator.distributed_type.value}, {accelerator.device}, "
        f"backbone {str(base.dtype).removeprefix('torch.')}")
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay)
    model, optimizer, scheduler, state = engine.prepare(accelerator, cfg, mtp, optimizer)  # mtp: unwrapped
    backward_step = engine.BackwardStep(accelerator, cfg, trainable, optimizer, scheduler)
    step, micro, tokens_seen = state["step"], state["micro_step"], state.get("tokens_seen", 0)
    clock = engine.TrainClock(state.get("train_seconds", 0.0))

    metrics, window = engine.MetricsWriter(accelerator, cfg), engine.Window(accelerator)
    bar = tqdm(total=cfg.max_steps, initial=step, desc="gated-lora", unit="step",
               disable=not accelerator.is_main_process)
    result = {}
    model.train()
    cached = cfg.cache_ntp and cfg.model.gated
    while step < cfg.max_steps:
        feats = engine.micro_batch(features, micro, accelerator, cfg)
        # the anchor draw depends on (seed, micro step, process) only: a resumed run draws the same
        draw = torch.Generator().manual_seed(hash((cfg.seed, micro, accelerator.process_index)) % 2**63)
        slots = [mask_inputs(f["input_ids"], f["labels"], cfg.model.k, choose_anchors(f["labels"], cfg.anchors, draw))
                 for f in feats]
        collated = collate_cached(slots) if cached else collate_mask_inputs(slots)
        batch = {k: v if v is None else v.to(accelerator.device) for k, v in collated.items()}
        with accelerator.accumulate(model):
            losses = model(**batch)
            skipped = backward_step(losses["loss"])
        micro += 1
        window.add(**losses)
        window.count(skipped_steps=skipped, slots=sum(s["input_ids"].numel() for s in slots),  # NTP + mask positions
                     ntp=sum(f["input_ids"].numel() for f in feats))
        if not accelerator.sync_gradients:
            continue
        step += 1
        bar.update(1)
        if step % cfg.log_every == 0 or step == cfg.max_steps:
            means, totals, seconds = window.reduce()
            tokens_seen += int(totals["ntp"])
            result = {"step": step, **means, "lr": scheduler.get_last_lr()[0], "slots_per_s": totals["slots"] / seconds,
                      "ntp_tokens_per_s": totals["ntp"] / seconds, "tokens_seen": tokens_seen,
                      "skipped_steps": int(totals["skipped_steps"])}
            metrics.write(result)
            bar.set_postfix(loss=f"{means['loss']:.3f}", mtp=f"{means.get('base_mtp', math.nan):.2f}",
                            acc1=f"{means.get('acc_m1', math.nan):.2f}")
        if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.max_steps) and prompts:
            # ZeRO-3: every process decodes the same prompts (its forwards gather the split weights);
            # the same weights and inputs take the same greedy path, so the forwards match one for one
            if engine.evaluates_here(accelerator):
                with accelerator.autocast():  # as in training (a half-precision backbone needs it)
                    result["sim_tau"] = engine.timed_eval(lambda: simulated_tau(mtp, prompts, cfg, eos),
                                                          step, clock, window, metrics)
                log(f"[eval] step {step}: simulated tau {result['sim_tau']:.3f} ({cfg.eval_decoding}, "
                    f"{len(prompts)} prompts)")
            accelerator.wait_for_everyone()  # the others wait here
        if step % cfg.save_every == 0 or step == cfg.max_steps:
            save_checkpoint(accelerator, model, optimizer, cfg, step,
                            {"micro_step": micro, "tokens_seen": tokens_seen,
                             "train_seconds": clock.seconds()},
                            functools.partial(METHODS["gated_lora"].save_head, mtp, base_model=cfg.backbone))
    bar.close()
    if accelerator.is_main_process and metrics.path.is_file():
        write_training_plot(metrics.path, Path(cfg.output_dir) / "metrics.png")
    del model  # see engine.finish
    engine.finish(accelerator)
    return result


if __name__ == "__main__":
    run_script(main)
