"""Train MTPC circuit heads (seed 003) over a frozen byte-level backbone.

    torchrun --nproc_per_node 2 train/mtpc.py --config configs/mtpc/byte-llama-12m_btree_n16.yaml \
        --data runs/distilled.jsonl --output-dir runs/mtpc/btree
    torchrun --nproc_per_node 8 train/mtpc.py --arch btree -n 16 --rank 32 --lora-layers 1 ...  # GPUs (NCCL)
    python train/mtpc.py --arch cp --n 8 ...                                                     # one process

Under torchrun the window is `-n 16` (or `--window 16`): torchrun's argument parser rejects
`--n` anywhere on its command line as an ambiguous abbreviation of its own options.

Every micro-step: the backbone encodes a batch of chat sequences (no gradient); the draft
features e_t are its final state, or its state after layer N - L passed through the draft's
own LoRA copy of the last L layers; the head turns e_t into a circuit over the next n bytes
at every position (or `--windows-per-sequence` random positions, to fit a CPU); the loss is the
NLL of the observed assistant bytes over the overlapping windows (Eq. 4: per example and
window offset, normalised by valid bytes, offsets discounted by gamma), optionally plus the KL
to the target's next-byte distribution at every window offset (App. G, `--kl-weight`).
DDP (gloo on CPU, NCCL on GPU) averages the head and LoRA gradients.

Writes to --output-dir: config.yaml, metrics.jsonl (loss, per-offset NLL, bytes/s; every
--eval-every steps a held-out acceptance estimate), checkpoint-N/ (head.safetensors,
optimizer.pt, trainer_state.json, config.yaml). `--resume auto` continues from the newest
checkpoint with the same losses as an uninterrupted run. A process that seems stuck prints
every thread's stack on `kill -USR1 PID`. `--init-from DIR` starts from the
head of an earlier run (the paper's two stages: heads first, then LoRA layers).

The held-out estimate ("teacher-forced acceptance"): on held-out answers, the mean number of
leading bytes of the head's greedy (max-product) window that equal the answer's next bytes.
When the answers are the target's own greedy output, that is the number of draft bytes a
greedy verification accepts per cycle.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import faulthandler
import gc
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file
from tqdm import tqdm

from mtpkit.data.chat import IGNORE, DataError, load_examples, tokenize_chat
from mtpkit.models.backbone import load_backbone
from mtpkit.models.mtpc.circuits import mode, next_log_probs
from mtpkit.models.mtpc import MTPCConfig, MTPCModel, window_loss, window_targets
from mtpkit.models.registry import METHODS
from mtpkit.train.checkpoints import micro_batch, prune_checkpoints, resume_folder, supersede_metrics
from mtpkit.train.config import ConfigError, add_config_args, resolve, to_yaml

DEFAULT_BYTE_BACKBONE = "mtpkit-byte-lm"


@dataclasses.dataclass
class TrainConfig:
    backbone: str = DEFAULT_BYTE_BACKBONE
    """byte-level target: a known name (mtpkit-byte-lm, tiny-byte-llama-random), a folder or a Hub id"""
    data: str = "runs/distilled.jsonl"
    """training chat data (.jsonl of messages) or a `datasets` name; assistant bytes carry the loss"""
    eval_data: str = ""
    """held-out chat data for the acceptance estimate ('' = every 20th record of --data, left out of training)"""
    output_dir: str = "runs/mtpc"
    """where config, metrics and checkpoints go"""
    max_steps: int = 500
    """optimizer steps"""
    batch_size: int = 1
    """sequences per process per micro-step"""
    grad_accum: int = 1
    """micro-steps per optimizer step"""
    lr: float = 3e-4
    """Adam learning rate (fixed, as in the paper)"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping (0 = off)"""
    max_length: int = 1024
    """bytes per sequence (longer conversations are cut)"""
    windows_per_sequence: int = 0
    """random window positions per sequence that carry the loss (0 = all)"""
    gamma: float = 0.0
    """discount of window offset j (gamma^(j-1)); 0 = the paper's 0.8, or 0.9 for n > 8"""
    kl_weight: float = 0.0
    """weight of the KL(target || circuit) loss on each window offset's conditional (App. G)"""
    seed: int = 0
    """seed of the head init, data order and window sampling"""
    log_every: int = 10
    """steps between metric lines"""
    save_every: int = 100
    """steps between checkpoints (the last step always saves)"""
    keep_checkpoints: int = 2
    """newest checkpoints kept on disk"""
    eval_every: int = 100
    """steps between held-out acceptance estimates (0 = off)"""
    eval_sequences: int = 8
    """held-out sequences per estimate"""
    resume: str = ""
    """checkpoint folder to resume from, or `auto` for the newest in output_dir"""
    init_from: str = ""
    """checkpoint (or export) folder whose head.safetensors initialises this run (stage two)"""
    dtype: str = "float32"
    """backbone dtype"""
    trust_remote_code: bool = False
    """allow custom model code (EvaByte)"""
    dist_timeout: int = 1800
    """seconds a process waits on the others in a collective before failing (under torchrun)"""
    model: MTPCConfig = dataclasses.field(default_factory=MTPCConfig)


def parse_args(argv=None) -> TrainConfig:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML config (configs/mtpc/*.yaml); flags override it")
    p.add_argument("--rank", dest="cfg__model__r", type=int, default=None, help="alias of --r: the circuit rank")
    # torchrun's own parser rejects `--n` after the script name (an ambiguous abbreviation of
    # its --nnodes/--nproc-per-node/...), so under torchrun write `-n 16` or `--window 16`
    p.add_argument("-n", "--window", dest="cfg__model__n", type=int, default=None,
                   help="alias of --n (use it under torchrun, which rejects --n)")
    add_config_args(p, TrainConfig)
    args = p.parse_args(argv)
    try:
        cfg = resolve(TrainConfig, args)
        cfg.model.__post_init__()
    except (ConfigError, ValueError) as e:
        p.error(str(e))
    if min(cfg.max_steps, cfg.batch_size, cfg.grad_accum, cfg.max_length) < 1:
        p.error("--max-steps, --batch-size, --grad-accum and --max-length must be >= 1")
    if not cfg.gamma:
        cfg.gamma = 0.9 if cfg.model.n > 8 else 0.8
    return cfg


def build_features(cfg: TrainConfig, tokenizer, log) -> tuple[list[dict], list[dict]]:
    """(train, held-out) sequences with next-byte labels on assistant bytes only."""
    examples, report = load_examples(cfg.data)
    if report.skipped:
        log(f"[data] {report.summary()}")
    if cfg.eval_data:
        held, _ = load_examples(cfg.eval_data)
        train = examples
    else:
        held, train = examples[19::20], [ex for i, ex in enumerate(examples) if i % 20 != 19]

    def featurise(exs):
        out, empty = [], 0
        for ex in exs:
            feat = tokenize_chat(tokenizer, ex.messages, max_length=cfg.max_length + 1)
            ids, labels = torch.tensor(feat["input_ids"]), torch.tensor(feat["labels"])
            if len(ids) < 2 or not (labels[1:] != IGNORE).any():
                empty += 1
                continue
            # labels[t] = the byte after input t, where that byte is the assistant's
            out.append({"input_ids": ids[:-1], "labels": labels[1:]})
        return out, empty

    train_f, empty = featurise(train)
    held_f, _ = featurise(held)
    if empty:
        log(f"[data] {cfg.data}: skipped {empty} record(s) with no assistant byte within --max-length")
    if not train_f:
        raise DataError(f"{cfg.data}: no training sequence with an assistant answer")
    return train_f, held_f


def pad(feats: list[dict], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    T = max(len(f["input_ids"]) for f in feats)
    ids = torch.full((len(feats), T), pad_id, dtype=torch.long)
    labels = torch.full((len(feats), T), IGNORE, dtype=torch.long)
    mask = torch.zeros(len(feats), T, dtype=torch.long)
    for b, f in enumerate(feats):
        n = len(f["input_ids"])
        ids[b, :n], labels[b, :n], mask[b, :n] = f["input_ids"], f["labels"], 1
    return ids, labels, mask


def select_windows(labels: torch.Tensor, n: int, per_sequence: int, generator: torch.Generator):
    """Window positions with at least one valid byte, optionally a random subset per sequence.
    Returns (batch index, position) [W], targets [W, n], valid [W, n]."""
    targets, valid = window_targets(labels, n)
    rows, cols = valid.any(-1).nonzero(as_tuple=True)
    if per_sequence:
        keep = []
        for b in range(labels.shape[0]):
            idx = (rows == b).nonzero(as_tuple=True)[0]
            keep.append(idx[torch.randperm(len(idx), generator=generator)[:per_sequence]])
        keep = torch.cat(keep).sort().values
        rows, cols = rows[keep], cols[keep]
    return rows, cols, targets[rows, cols], valid[rows, cols]


def kl_loss(model: MTPCModel, params, targets, valid, ids, rows, cols) -> torch.Tensor:
    """App. G: sum over offsets j of KL(p_target(x_{t+j} | gold prefix) || q(x_{t+j} | gold window prefix)),
    averaged over valid bytes. The target's conditionals come from its logits at t + j - 1."""
    with torch.no_grad():
        logits = model.backbone(input_ids=ids).logits.float().log_softmax(-1)  # [B, T, V]
    total, count = 0.0, 0
    T = ids.shape[1]
    for j in range(model.cfg.n):
        pos = cols + j
        ok = valid[:, j] & (pos < T)
        if not ok.any():
            continue
        sub = params.index(ok.nonzero(as_tuple=True)[0])
        q = next_log_probs(sub, targets[ok], j)  # [w, V]
        p = logits[rows[ok], pos[ok]]
        total = total + F.kl_div(q, p, log_target=True, reduction="sum")
        count += int(ok.sum())
    return total / max(count, 1)


@torch.no_grad()
def teacher_forced_acceptance(model: MTPCModel, held: list[dict], pad_id: int, limit: int) -> float:
    """Mean leading bytes of the greedy window equal to the held-out answer, over every position
    whose next byte is the assistant's (see the module docstring)."""
    was = model.training
    model.eval()
    matched, windows = 0.0, 0
    for f in held[:limit]:
        ids, labels, _ = pad([f], pad_id)
        e = model.features(ids)[0]
        targets, valid = window_targets(labels, model.cfg.n)
        pos = valid[0, :, 0].nonzero(as_tuple=True)[0]
        if len(pos) == 0:
            continue
        draft = mode(model.head(e[pos]))
        ok = (draft == targets[0, pos]) & valid[0, pos]
        matched += float(ok.long().cumprod(-1).sum())
        windows += len(pos)
    model.train(was)
    return matched / max(windows, 1)


def main(argv=None) -> dict:
    cfg = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = torch.device("cpu")
    if world > 1:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=cfg.dist_timeout))
        if backend == "nccl":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
    main_process = rank == 0
    log = (lambda msg: tqdm.write(msg)) if main_process else (lambda msg: None)
    out = Path(cfg.output_dir)
    command = " ".join((["torchrun"] if world > 1 else ["python"]) + sys.argv)
    if main_process:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(to_yaml(cfg, command))

    backbone, tokenizer = load_backbone(cfg.backbone, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code)
    backbone.to(device)
    try:
        train, held = build_features(cfg, tokenizer, log)
    except DataError as e:
        sys.exit(f"mtpc: {e}")
    torch.manual_seed(cfg.seed)  # peft draws the LoRA A matrices from the global generator
    model = MTPCModel(backbone, cfg.model, seed=cfg.seed).to(device)
    if cfg.init_from:
        state = load_file(str(Path(cfg.init_from) / "head.safetensors"))
        missing = model.load_state_dict(state, strict=False)
        log(f"[init] {cfg.init_from}: {len(state)} tensors; new: {len(missing.missing_keys)}")
    trainable = [p for p in model.parameters() if p.requires_grad]
    log(f"[model] {cfg.backbone}: MTPC {cfg.model.arch} n={cfg.model.n} r={cfg.model.units}, "
        f"{cfg.model.lora_layers} LoRA draft layer(s), {sum(p.numel() for p in trainable) / 1e6:.2f}M trainable; "
        f"{len(train)} training / {len(held)} held-out sequences; {world} process(es)")
    ddp = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay)

    step, micro, bytes_seen = 0, 0, 0
    resume = resume_folder(cfg.resume, out)
    if resume is not None:
        if not (resume / "trainer_state.json").is_file():
            sys.exit(f"mtpc: --resume {resume}: not a checkpoint (no trainer_state.json)")
        model.load_state_dict(load_file(str(resume / "head.safetensors")), strict=False)
        optimizer.load_state_dict(torch.load(resume / "optimizer.pt", weights_only=True))
        state = json.loads((resume / "trainer_state.json").read_text())
        step, micro, bytes_seen = state["step"], state["micro_step"], state["bytes_seen"]
        log(f"[resume] {resume} at step {step}")
        if main_process:
            supersede_metrics(out / "metrics.jsonl", step, log)

    metrics_file = out / "metrics.jsonl"
    bar = tqdm(total=cfg.max_steps, initial=step, desc=f"mtpc-{cfg.model.arch}", unit="step", disable=not main_process)
    window = {"t": time.perf_counter(), "loss": 0.0, "nll": 0.0, "kl": 0.0, "per_offset": 0.0, "n": 0, "bytes": 0}
    result = {}
    model.train()
    while step < cfg.max_steps:
        for accum in range(cfg.grad_accum):
            feats = micro_batch(train, micro, rank, world, cfg.batch_size, cfg.seed)
            ids, labels, mask = (t.to(device) for t in pad(feats, tokenizer.pad_token_id))
            g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + micro * world + rank)
            rows, cols, targets, valid = select_windows(labels.cpu(), cfg.model.n, cfg.windows_per_sequence, g)
            rows, cols, targets, valid = rows.to(device), cols.to(device), targets.to(device), valid.to(device)
            sync = accum == cfg.grad_accum - 1 or world == 1
            with ddp.no_sync() if not sync and world > 1 else contextlib.nullcontext():
                params = ddp(ids, mask, rows, cols)  # through DDP's forward, so gradients are all-reduced
                nll, per_offset = window_loss(params, targets, valid, rows, ids.shape[0], cfg.gamma)
                kl = kl_loss(model, params, targets, valid, ids, rows, cols) if cfg.kl_weight else nll.new_zeros(())
                loss = nll + cfg.kl_weight * kl
                (loss / cfg.grad_accum).backward()
            micro += 1
            window["loss"] += float(loss.detach())
            window["nll"] += float(nll.detach())
            window["kl"] += float(kl.detach())
            window["per_offset"] = window["per_offset"] + per_offset
            window["n"] += 1
            window["bytes"] += int((labels != IGNORE).sum())
        if cfg.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(trainable, cfg.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        bar.update(1)
        if step % cfg.log_every == 0 or step == cfg.max_steps:
            seconds = time.perf_counter() - window["t"]
            stats = torch.tensor([window["loss"], window["nll"], window["kl"], window["bytes"]], dtype=torch.float64)
            per_offset = window["per_offset"].detach().double().cpu()
            if world > 1:
                for t in (stats, per_offset):
                    dist.all_reduce(t)
                stats[:3] /= world
                per_offset /= world
            bytes_seen += int(stats[3])
            result = {"step": step, "loss": float(stats[0]) / window["n"], "nll": float(stats[1]) / window["n"],
                      "kl": float(stats[2]) / window["n"],
                      "nll_per_offset": [round(float(v) / window["n"], 4) for v in per_offset],
                      "assistant_bytes_per_s": float(stats[3]) / seconds, "bytes_seen": bytes_seen}
            if main_process:
                with open(metrics_file, "a") as f:
                    f.write(json.dumps(result) + "\n")
                bar.set_postfix(loss=f"{result['loss']:.3f}", nll1=f"{result['nll_per_offset'][0]:.2f}")
            window = {"t": time.perf_counter(), "loss": 0.0, "nll": 0.0, "kl": 0.0, "per_offset": 0.0, "n": 0,
                      "bytes": 0}
        if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.max_steps) and held:
            if main_process:
                t0 = time.perf_counter()
                acc = teacher_forced_acceptance(model, held, tokenizer.pad_token_id, cfg.eval_sequences)
                with open(metrics_file, "a") as f:
                    f.write(json.dumps({"step": step, "tf_acceptance": acc,
                                        "eval_seconds": time.perf_counter() - t0}) + "\n")
                log(f"[eval] step {step}: teacher-forced acceptance {acc:.3f} bytes/cycle (greedy window)")
                result["tf_acceptance"] = acc
                window["t"] = time.perf_counter()
            if world > 1:
                dist.barrier()
        if step % cfg.save_every == 0 or step == cfg.max_steps:
            if main_process:
                ckpt = out / f"checkpoint-{step}"
                METHODS["mtpc"].save_head(model, ckpt, cfg.backbone)
                torch.save(optimizer.state_dict(), ckpt / "optimizer.pt")
                (ckpt / "config.yaml").write_text(to_yaml(cfg, command))
                (ckpt / "trainer_state.json").write_text(json.dumps(
                    {"step": step, "micro_step": micro, "bytes_seen": bytes_seen}))
                prune_checkpoints(out, cfg.keep_checkpoints)
            if world > 1:
                dist.barrier()
    bar.close()
    if world > 1:
        # DDP's reducer holds the process group: free it while every rank is still here, or a
        # rank's exit can wait forever on its peer's closed sockets (seen 1 run in ~15 on gloo)
        del ddp
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
    return result


if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a stuck run: `kill -USR1 PID` prints its stacks
    main()
