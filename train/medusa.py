"""Train Medusa-1 or Hydra draft heads over a frozen backbone on self-distilled chat data
("Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads", Cai et al.,
arXiv:2401.10774, Medusa-1; "Hydra: Sequentially-Dependent Draft Heads for Medusa Decoding",
Ankner et al., arXiv:2402.05109).

    python data/distill.py --data builtin:train --out runs/distilled.jsonl --max-new-tokens 128
    python train/medusa.py --config configs/medusa/smollm2-135m_medusa.yaml
    python train/medusa.py --config configs/medusa/smollm2-135m_hydra.yaml      # --arch hydra
    accelerate launch train/medusa.py --config configs/medusa/llama3.1-8b_hydra.yaml   # GPUs

The backbone is frozen, so its last hidden states over the training data are computed once
(`--features cache`: one forward per sequence, kept in memory and in `--feature-cache`, a
safetensors file that a later run with the same backbone, data and --max-length reads back, e.g.
the Hydra run after the Medusa one) and every step trains the heads alone on them: no backbone
forward or backward per step. `--features online` runs the frozen backbone on each micro-batch
instead (data too large to keep). Every micro-step: `anchor_rows` of each sequence (every
position whose next-but-one token is the assistant's, or `--positions` of them at random), the
heads' losses (`MedusaHeads.forward`: cross-entropy on the data tokens x_{t+i+1}, or with
`--distill 1` the KL to the target's own distribution over them, read off the cached states
through the frozen LM head: Hydra++'s teacher distillation), head i weighted by
`--decay`^(i-1), backward into the heads.

Writes to --output-dir: config.yaml, metrics.jsonl (loss, per-head loss and top-1 accuracy,
rows/s; `features_seconds` once; `sim_tau` every --eval-every steps: tokens per target call of
real greedy speculative decoding with the heads, `--eval-tree`, on held-out prompts),
metrics.png, checkpoint-N/ (train/checkpoints.py: state/, trainer_state.json, config.yaml and
head/, the loadable head). `--resume auto` continues from the newest checkpoint with the same
losses as an uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from mtpkit.data.chat import DataError
from mtpkit.eval.report import write_training_plot
from mtpkit.models.arch import adapter_for
from mtpkit.models.atomic_write import replacing
from mtpkit.models.backbone import eos_token_ids, load_backbone
from mtpkit.models.decoding.decoder import Target, tokens_per_call
from mtpkit.models.head_folder import backbone_identity
from mtpkit.models.medusa import MedusaConfig, MedusaDraftConfig, MedusaDrafter, MedusaHeads, anchor_rows, collate_rows
from mtpkit.models.medusa.model import ARCHS, LM_HEADS
from mtpkit.models.process import run_script
from mtpkit.models.registry import METHODS
from mtpkit.train import engine, recipe_config
from mtpkit.train.checkpoints import save_checkpoint
from mtpkit.train.config import Rule, above, at_least, between, one_of
from mtpkit.train.gated_lora import build_features, eval_prompts
from mtpkit.train.recipe_config import HeadTrainArgs

FEATURES = ("cache", "online")


@dataclasses.dataclass
class TrainConfig(HeadTrainArgs):
    output_dir: str = "runs/medusa"
    max_steps: int = 300
    lr: float = 1e-3
    """peak AdamW learning rate (Medusa-1 trains its heads at 1e-3)"""
    positions: int = 0
    """anchor positions per sequence per micro-step, drawn at random (0 = every position whose
    head-1 target is an assistant token)"""
    distill: bool = False
    """train to the target's own distribution over each head's token (KL, Hydra++'s teacher
    distillation) instead of the data token (cross-entropy, Medusa-1's); on self-distilled data
    both target the backbone, the KL with its whole distribution"""
    decay: float = 0.8
    """weight of head i's loss is decay^(i-1) (Medusa's lambda_k = 0.8^k)"""
    features: str = "cache"
    """cache: the frozen backbone's hidden states computed once (and kept in --feature-cache) |
    online: computed by a backbone forward every micro-step (data too large to keep)"""
    feature_cache: str = ""
    """safetensors file of the cached hidden states, read back when it matches this run's backbone,
    data and --max-length ('' = output_dir/features.safetensors); runs sharing one train both archs
    on one backbone pass"""
    eval_prompts: int = 4
    """held-out prompts per simulated-tau measurement (every --eval-every steps)"""
    eval_max_new_tokens: int = 48
    """tokens generated per simulated-tau prompt"""
    eval_tree: str = ""
    """draft tree of the simulated tau ('' = the top-1 chain of every head; e.g. chain2 or
    mc_sim_7b_63: see the medusa drafter's `tree`)"""
    model: MedusaConfig = dataclasses.field(default_factory=MedusaConfig)


RULES: tuple[Rule, ...] = recipe_config.HEAD_TRAIN_RULES + (
    ("positions", *at_least(0)),
    ("decay", *between(0, 1)),
    ("decay", *above(0)),
    ("features", *one_of(FEATURES)),
    ("eval_prompts", *at_least(1)),
    ("eval_max_new_tokens", *at_least(1)),
    ("arch", *one_of(ARCHS)),
    ("heads", *at_least(1)),
    ("layers", *at_least(1)),
    ("lm_head", *one_of(LM_HEADS)),
)
"""the recipe's own rules (after recipe_config.TRAIN_RULES)"""


def parse_args(argv=None) -> TrainConfig:
    p = recipe_config.argument_parser(TrainConfig, __doc__, "configs/medusa/*.yaml")
    return recipe_config.parse_config(p, TrainConfig, argv, RULES)


def cache_key(cfg: TrainConfig, backbone) -> str:
    """What the cached features depend on: the backbone (name, architecture hash, dtype), the data
    file (path, size, modification time) and --max-length."""
    data = Path(cfg.data)
    stat = data.stat() if data.is_file() else None
    key = {"backbone": backbone_identity(backbone, cfg.backbone), "dtype": str(backbone.dtype),
           "data": cfg.data, "data_size": stat.st_size if stat else None,
           "data_mtime": stat.st_mtime_ns if stat else None, "max_length": cfg.max_length}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


@torch.no_grad()
def backbone_hidden(backbone, input_ids: torch.Tensor) -> torch.Tensor:
    """The frozen backbone's last hidden states [T, d] (final-normed: what its LM head reads)."""
    body = adapter_for(backbone).body
    return body(input_ids=input_ids[None].to(backbone.device)).last_hidden_state[0]


def cached_features(cfg: TrainConfig, features: list[dict], backbone, accelerator, log) -> float:
    """Put each sequence's hidden states [T, d] under "hidden" (on the CPU), read from
    --feature-cache when it matches (`cache_key`), else computed and written there, then read by
    every process. Every process computes a share, sequence i on process i % processes (so no
    process waits at a collective through the whole pass, which --dist-timeout would end); the
    others' shares reach the main process through files in output_dir (which every process
    writes to, as with checkpoints) and it alone writes the cache. Returns the seconds computing
    (or reading) took."""
    path = Path(cfg.feature_cache or Path(cfg.output_dir) / "features.safetensors")
    key = cache_key(cfg, backbone)
    rank, world = accelerator.process_index, accelerator.num_processes
    t0 = time.perf_counter()

    def matches() -> bool:
        if not path.is_file():
            return False
        try:
            with safe_open(str(path), framework="pt") as f:
                return (f.metadata() or {}).get("key") == key
        except Exception:  # a truncated or foreign file: computed again
            return False

    def shard(r: int) -> Path:  # process r's share on its way to the main process
        return Path(cfg.output_dir) / f".features.rank{r}-of-{world}.safetensors"

    # the main process decides for all (another run sharing the cache may write it meanwhile)
    stale = torch.tensor([float(accelerator.is_main_process and not matches())], device=accelerator.device)
    if accelerator.reduce(stale, reduction="sum").item() > 0:
        log(f"[features] the frozen backbone over {len(features)} sequences on {world} process(es) -> {path}")
        mine = [backbone_hidden(backbone, f["input_ids"]).cpu()
                for f in tqdm(features[rank::world], desc="features", unit="seq", leave=False,
                              disable=not accelerator.is_main_process)]
        if rank > 0 and mine:  # (more processes than sequences: some have none)
            shard(rank).parent.mkdir(parents=True, exist_ok=True)
            with replacing(shard(rank)) as tmp:
                save_file({"hidden": torch.cat(mine).contiguous()}, str(tmp))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            shares = [mine]  # the main process's own share stays in memory
            for r in range(1, min(world, len(features))):
                with safe_open(str(shard(r)), framework="pt") as f:
                    shares.append(f.get_tensor("hidden").split([len(x["input_ids"]) for x in features[r::world]]))
                shard(r).unlink()
            hidden = [shares[i % world][i // world] for i in range(len(features))]  # back in data order
            path.parent.mkdir(parents=True, exist_ok=True)
            with replacing(path) as tmp:
                save_file({"hidden": torch.cat(hidden).contiguous()}, str(tmp),
                          metadata={"key": key, "lengths": json.dumps([len(h) for h in hidden])})
            del shares, hidden
            log(f"[features] {sum(len(f['input_ids']) for f in features)} positions in "
                f"{time.perf_counter() - t0:.1f} s")
        del mine
    else:
        log(f"[features] read from {path} (this backbone, data and --max-length)")
    accelerator.wait_for_everyone()
    with safe_open(str(path), framework="pt") as f:
        lengths = json.loads(f.metadata()["lengths"])
        hidden = f.get_tensor("hidden")
    if lengths != [len(f["input_ids"]) for f in features]:
        raise SystemExit(f"medusa: {path} does not hold this data's sequences; delete it or pass --feature-cache")
    for f, h in zip(features, hidden.split(lengths)):
        f["hidden"] = h
    return time.perf_counter() - t0


@torch.no_grad()
def simulated_tau(heads: MedusaHeads, backbone, prompts: list[list[int]], cfg: TrainConfig, eos) -> float:
    """Tokens per target call of greedy speculative decoding with the current heads."""
    was_training = heads.training
    drafter = MedusaDrafter(MedusaDraftConfig(tree=cfg.eval_tree), model=heads)
    target = Target(backbone)
    tau = tokens_per_call(target, drafter, prompts, cfg.eval_max_new_tokens, eos)
    heads.train(was_training)
    return tau


def main(argv=None) -> dict:
    cfg = parse_args(argv)
    accelerator = engine.setup(cfg, old_layout="start a new run")
    log = engine.printer(accelerator)
    device = accelerator.device

    backbone, tokenizer = load_backbone(cfg.backbone, dtype=engine.backbone_dtype(cfg, accelerator),
                                        trust_remote_code=cfg.trust_remote_code, device=device)
    for p in backbone.parameters():
        p.requires_grad_(False)
    eos = eos_token_ids(backbone, tokenizer)
    try:
        features, train_text = build_features(cfg, tokenizer, log)
        prompts = eval_prompts(cfg, tokenizer, train_text) if cfg.eval_every else []
    except DataError as e:
        sys.exit(f"medusa: {e}")
    feature_seconds = cached_features(cfg, features, backbone, accelerator, log) if cfg.features == "cache" else None
    torch.manual_seed(cfg.seed)
    heads = MedusaHeads(backbone, cfg.model)
    trainable = engine.float32_trainable(heads.parameters())
    K = cfg.model.heads
    prefix = ", prefix layer" if cfg.model.prefix_layer else ""
    log(f"[model] {cfg.backbone}: {cfg.model.arch} K={K} heads of {cfg.model.layers} block(s), lm_head "
        f"{cfg.model.lm_head}{prefix}, {sum(p.numel() for p in trainable) / 1e6:.2f}M trainable; {len(features)} "
        f"training sequences ({sum(len(f['input_ids']) for f in features)} tokens), features {cfg.features}; "
        f"{accelerator.num_processes} process(es), {device}, backbone {str(backbone.dtype).removeprefix('torch.')}")
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay)
    model, optimizer, scheduler, state = engine.prepare(accelerator, cfg, heads, optimizer)  # heads: unwrapped
    backward_step = engine.BackwardStep(accelerator, cfg, trainable, optimizer, scheduler)
    step, micro, tokens_seen = state["step"], state["micro_step"], state.get("tokens_seen", 0)
    clock = engine.TrainClock(state.get("train_seconds", 0.0))

    metrics, window = engine.MetricsWriter(accelerator, cfg), engine.Window(accelerator)
    if feature_seconds is not None:
        metrics.write({"step": step, "features_seconds": feature_seconds,
                       "feature_positions": sum(len(f["hidden"]) for f in features)})
    bar = tqdm(total=cfg.max_steps, initial=step, desc=cfg.model.arch, unit="step",
               disable=not accelerator.is_main_process)
    result = {}
    model.train()
    while step < cfg.max_steps:
        feats = engine.micro_batch(features, micro, accelerator, cfg)
        # the anchor draw depends on (seed, micro step, process) only: a resumed run draws the same
        draw = torch.Generator().manual_seed(cfg.seed * 1_000_003 + micro * accelerator.num_processes
                                             + accelerator.process_index)
        parts = [anchor_rows(f["hidden"] if "hidden" in f else backbone_hidden(backbone, f["input_ids"]).cpu(),
                             f["input_ids"], f["labels"], K, cfg.positions, draw, teacher=cfg.distill) for f in feats]
        batch = {k: v.to(device) for k, v in collate_rows(parts, sequences=cfg.model.prefix_layer).items()}
        with accelerator.accumulate(model):
            losses = model(**batch, decay=cfg.decay)
            skipped = backward_step(losses["loss"])
        micro += 1
        window.add(**losses)
        window.count(skipped_steps=skipped, rows=len(batch["hidden"]), tokens=sum(len(f["input_ids"]) for f in feats))
        if not accelerator.sync_gradients:
            continue
        step += 1
        bar.update(1)
        if step % cfg.log_every == 0 or step == cfg.max_steps:
            means, totals, seconds = window.reduce()
            tokens_seen += int(totals["tokens"])
            result = {"step": step, **means, "lr": scheduler.get_last_lr()[0], "rows_per_s": totals["rows"] / seconds,
                      "tokens_seen": tokens_seen, "skipped_steps": int(totals["skipped_steps"])}
            metrics.write(result)
            bar.set_postfix(loss=f"{means['loss']:.3f}", acc1=f"{means.get('acc_h1', math.nan):.2f}")
        if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.max_steps) and prompts:
            if engine.evaluates_here(accelerator):
                with accelerator.autocast():  # as in training (a half-precision backbone needs it)
                    result["sim_tau"] = engine.timed_eval(lambda: simulated_tau(heads, backbone, prompts, cfg, eos),
                                                          step, clock, window, metrics)
                log(f"[eval] step {step}: simulated tau {result['sim_tau']:.3f} (tree {cfg.eval_tree or f'chain{K}'}, "
                    f"{len(prompts)} prompts)")
            accelerator.wait_for_everyone()
        if step % cfg.save_every == 0 or step == cfg.max_steps:
            save_checkpoint(accelerator, model, optimizer, cfg, step, {"micro_step": micro, "tokens_seen": tokens_seen,
                             "train_seconds": clock.seconds()},
                            functools.partial(METHODS[cfg.model.arch].save_head, heads, base_model=cfg.backbone))
    bar.close()
    if accelerator.is_main_process and metrics.path.is_file():
        write_training_plot(metrics.path, Path(cfg.output_dir) / "metrics.png")
    del model  # see engine.finish
    engine.finish(accelerator)
    return result


if __name__ == "__main__":
    run_script(main)
