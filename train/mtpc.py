"""Train MTPC circuit heads over a frozen byte-level backbone: the recipe of "Fast and Expressive
Multi-Byte Prediction with Probabilistic Circuits" (arXiv:2511.11346).

    torchrun --nproc_per_node 2 train/mtpc.py --config configs/mtpc/byte-llama-12m_btree_n16.yaml \
        --data runs/distilled.jsonl --output-dir runs/mtpc/btree
    torchrun --nproc_per_node 8 train/mtpc.py --arch btree --n 16 --rank 32 --lora-layers 1 ...  # GPUs (NCCL)
    accelerate launch --config_file configs/accelerate/cpu_ddp.yaml train/mtpc.py ...             # the same
    python train/mtpc.py --arch cp --n 8 ...                                                      # one process

`--n 16` after the script under torchrun needs mtpkit's torchrun hook (train/torchrun_args.py,
installed by `make install`): stock torchrun's parser rejects `--n` anywhere on its command line
as an ambiguous abbreviation of its own options. `-n 16` and `--window 16` work everywhere.

Every micro-step: the backbone encodes a batch of chat sequences (no gradient); the draft
features e_t are its final state, or its state after layer N - L passed through the draft's
own LoRA copy of the last L layers; the head turns e_t into a circuit over the next n bytes
at every position (or `--windows-per-sequence` random positions, to fit a CPU); the loss is the
NLL of the observed assistant bytes over the overlapping windows (Eq. 4: per example and
window offset, normalised by valid bytes, offsets discounted by gamma), optionally plus the KL
to the target's next-byte distribution at every window offset (App. G, `--kl-weight`).
DDP through accelerate (gloo on CPU, NCCL on GPU) averages the head and LoRA gradients.

Writes to --output-dir: config.yaml, metrics.jsonl (loss, per-offset NLL, bytes/s; every
--eval-every steps a held-out acceptance estimate), metrics.png (the loss curve, at the end),
checkpoint-N/ (train/checkpoints.py: state/, trainer_state.json, config.yaml and head/, the
loadable head). `--resume auto` continues from the newest checkpoint with the same losses as an
uninterrupted run. A process that seems stuck prints every thread's stack on `kill -USR1 PID`.
`--init-from DIR` starts from the head of an earlier run (the paper's two stages: heads first,
then LoRA layers).
`--pack 1` is the paper's data layout (whole examples packed into sequences of --max-length
positions, the longer ones dropped, each example encoded on its own: data/packed.py); `--epochs E`
sets --max-steps to E passes over the sequences; metrics.jsonl records the `epoch` reached.

The held-out estimate ("teacher-forced acceptance"): on held-out answers, the mean number of
leading bytes of the head's greedy (max-product) window that equal the answer's next bytes.
When the answers are the target's own greedy output, that is the number of draft bytes a
greedy verification accepts per cycle.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import faulthandler
import signal
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from mtpkit.data.chat import IGNORE, DataError, load_examples, tokenize_chat
from mtpkit.data.packed import pack_examples, pad_packed, window_targets_packed
from mtpkit.eval.report import write_training_plot
from mtpkit.models.backbone import load_backbone
from mtpkit.models.mtpc.circuits import ARCHS, mode, next_log_probs
from mtpkit.models.mtpc import MTPCConfig, MTPCModel, window_loss, window_targets
from mtpkit.models.head_folder import head_folder, read_weights
from mtpkit.models.process import run_script
from mtpkit.models.registry import METHODS
from mtpkit.train import engine, recipe_config
from mtpkit.train.checkpoints import save_checkpoint
from mtpkit.train.config import Rule, above, at_least, between, one_of
from mtpkit.train.recipe_config import HeadTrainArgs

DEFAULT_BYTE_BACKBONE = "mtpkit-byte-lm"


@dataclasses.dataclass
class TrainConfig(HeadTrainArgs):
    output_dir: str = "runs/mtpc"
    max_steps: int = 500
    lr: float = 3e-4
    """peak AdamW learning rate (fixed, as in the paper)"""
    seed: int = 0
    """seed of the head init, data order and window sampling"""
    log_every: int = 10
    backbone: str = DEFAULT_BYTE_BACKBONE
    eval_data: str = ""
    max_length: int = 1024
    windows_per_sequence: int = 0
    """random window positions per sequence that carry the loss (0 = all)"""
    gamma: float = 0.0
    """discount of window offset j (gamma^(j-1)); 0 = the paper's 0.8, or 0.9 for n > 8"""
    kl_weight: float = 0.0
    """weight of the KL(target || circuit) loss on each window offset's conditional (App. G)"""
    eval_sequences: int = 8
    """held-out sequences per acceptance estimate (every --eval-every steps)"""
    init_from: str = ""
    """checkpoint (or export) folder whose head initialises this run (stage two)"""
    pack: bool = False
    """the paper's layout: whole examples packed into sequences of --max-length positions, each
    encoded on its own (no attention across examples), no window across an example's end; examples
    longer than a sequence are dropped (without --pack: one example per sequence, cut there)"""
    epochs: float = 0.0
    """budget in epochs over the training sequences (packed or not): sets --max-steps to
    ceil(epochs x sequences / (batch x processes x grad-accum)); 0 = --max-steps as given"""
    model: MTPCConfig = dataclasses.field(default_factory=MTPCConfig)


RULES: tuple[Rule, ...] = recipe_config.HEAD_TRAIN_RULES + (
    ("windows_per_sequence", *at_least(0)),
    ("gamma", *between(0, 1)),
    ("kl_weight", *at_least(0)),
    ("eval_sequences", *at_least(1)),
    ("epochs", *at_least(0)),
    ("arch", *one_of(ARCHS + ("cirkit",))),
    ("n", *at_least(2)),
    ("n", lambda v, cfg: cfg.model.arch != "btree" or v & (v - 1) == 0, "a power-of-two window for --arch btree"),
    ("r", *at_least(1)),
    ("init_std", *above(0)),
    ("lora_layers", *at_least(0)),
    ("lora_rank", *at_least(1)),
    ("lora_alpha", *above(0)),
)
"""the recipe's own rules (after recipe_config.TRAIN_RULES); --rank is --r, -n/--window is --n"""


def parse_args(argv=None) -> TrainConfig:
    p = recipe_config.argument_parser(TrainConfig, __doc__, "configs/mtpc/*.yaml")
    p.add_argument("--rank", dest="cfg__model__r", type=int, default=None, help="alias of --r: the circuit rank")
    # stock torchrun's parser rejects `--n` after the script name (an ambiguous abbreviation of its
    # --nnodes/--nproc-per-node/...) unless mtpkit's hook is installed (train/torchrun_args.py)
    p.add_argument("-n", "--window", dest="cfg__model__n", type=int, default=None,
                   help="alias of --n (works under a torchrun without mtpkit's hook, which rejects --n)")
    return recipe_config.parse_config(p, TrainConfig, argv, RULES, finish=_finish)


def _finish(cfg: TrainConfig) -> None:
    cfg.model.__post_init__()  # the model config's own checks, on the values the flags set
    if not cfg.gamma:
        cfg.gamma = 0.9 if cfg.model.n > 8 else 0.8


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

    def featurise(exs, cut=cfg.max_length + 1):
        out, empty = [], 0
        for ex in exs:
            feat = tokenize_chat(tokenizer, ex.messages, max_length=cut)
            ids, labels = torch.tensor(feat["input_ids"]), torch.tensor(feat["labels"])
            if len(ids) < 2 or not (labels[1:] != IGNORE).any():
                empty += 1
                continue
            # labels[t] = the byte after input t, where that byte is the assistant's
            out.append({"input_ids": ids[:-1], "labels": labels[1:]})
        return out, empty

    # packed: whole examples of at most --max-length input positions (max_length + 1 bytes), the rest dropped
    train_f, empty = featurise(train, cut=None if cfg.pack else cfg.max_length + 1)
    held_f, _ = featurise(held)
    if empty:
        log(f"[data] {cfg.data}: skipped {empty} record(s) with no assistant byte within --max-length")
    if cfg.pack:
        examples = len(train_f)
        train_f, dropped = pack_examples(train_f, cfg.max_length, seed=cfg.seed)
        log(f"[data] packed {examples - dropped} examples into {len(train_f)} sequences of at most "
            f"{cfg.max_length} positions; dropped {dropped} longer than that")
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


def select_windows(labels: torch.Tensor, n: int, per_sequence: int, generator: torch.Generator,
                   segments: torch.Tensor | None = None):
    """Window positions with at least one valid byte, optionally a random subset per sequence;
    packed (`segments`): a window's bytes past its example's end are invalid.
    Returns (batch index, position) [W], targets [W, n], valid [W, n]."""
    targets, valid = window_targets(labels, n) if segments is None else window_targets_packed(labels, segments, n)
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
def teacher_forced_acceptance(model: MTPCModel, held: list[dict], pad_id: int, limit: int,
                              device: torch.device | str = "cpu") -> float:
    """Mean leading bytes of the greedy window equal to the held-out answer, over every position
    whose next byte is the assistant's (see the module docstring); computed on `device`, the model's."""
    was = model.training
    model.eval()
    matched, windows = 0.0, 0
    for f in held[:limit]:
        ids, labels, _ = (t.to(device) for t in pad([f], pad_id))
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
    accelerator = engine.setup(cfg, old_layout="start a new run from its head with --init-from {folder}")
    log = engine.printer(accelerator)
    rank, world, device = accelerator.process_index, accelerator.num_processes, accelerator.device
    if cfg.init_from:  # read before the backbone loads, so a wrong folder fails at once
        try:
            init_state = read_weights(head_folder(cfg.init_from) / "head.safetensors")
        except (OSError, ValueError) as e:
            sys.exit(f"mtpc: --init-from {cfg.init_from}: {e}")
    # outside the model's state and DDP: frozen, read again from --backbone
    backbone, tokenizer = load_backbone(cfg.backbone, dtype=engine.backbone_dtype(cfg, accelerator),
                                        trust_remote_code=cfg.trust_remote_code, device=device)
    try:
        train, held = build_features(cfg, tokenizer, log)
    except DataError as e:
        sys.exit(f"mtpc: {e}")
    if cfg.epochs:  # before prepare: the schedule and the saved config.yaml read max_steps
        world_steps = cfg.batch_size * world * cfg.grad_accum
        cfg.max_steps = max(1, math.ceil(cfg.epochs * len(train) / world_steps))
        log(f"[budget] {cfg.epochs:g} epoch(s) of {len(train)} sequences: --max-steps {cfg.max_steps}")
    torch.manual_seed(cfg.seed)  # peft draws the LoRA A matrices from the global generator
    mtpc = MTPCModel(backbone, cfg.model, seed=cfg.seed)
    if cfg.init_from:
        missing = mtpc.load_state_dict(init_state, strict=False)
        log(f"[init] {cfg.init_from}: {len(init_state)} tensors; new: {len(missing.missing_keys)}")
    trainable = engine.float32_trainable(p for p in mtpc.parameters() if p.requires_grad)
    log(f"[model] {cfg.backbone}: MTPC {cfg.model.arch} n={cfg.model.n} r={cfg.model.units}, "
        f"{cfg.model.lora_layers} LoRA draft layer(s), {sum(p.numel() for p in trainable) / 1e6:.2f}M trainable; "
        f"{len(train)} training / {len(held)} held-out sequences; {world} process(es), {device}, "
        f"backbone {str(backbone.dtype).removeprefix('torch.')}")
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay)
    model, optimizer, scheduler, state = engine.prepare(accelerator, cfg, mtpc, optimizer)  # mtpc: unwrapped
    backward_step = engine.BackwardStep(accelerator, cfg, trainable, optimizer, scheduler)
    step, micro, bytes_seen = state["step"], state["micro_step"], state.get("bytes_seen", 0)
    per_step = cfg.batch_size * world * cfg.grad_accum
    log(f"[data] one epoch = {len(train)} sequences = {len(train) / per_step:.2f} steps of {per_step}; "
        f"{cfg.max_steps} steps = {cfg.max_steps * per_step / len(train):.3f} epochs")

    metrics, window = engine.MetricsWriter(accelerator, cfg), engine.Window(accelerator)
    bar = tqdm(total=cfg.max_steps, initial=step, desc=f"mtpc-{cfg.model.arch}", unit="step",
               disable=not accelerator.is_main_process)
    result = {}
    model.train()
    while step < cfg.max_steps:
        feats = engine.micro_batch(train, micro, accelerator, cfg)
        if cfg.pack:  # no attention mask: each example is encoded on its own (MTPCModel.features)
            ids, labels, segments = pad_packed(feats, tokenizer.pad_token_id)
            mask = None
        else:
            (ids, labels, mask), segments = pad(feats, tokenizer.pad_token_id), None
        ids, labels, mask = ids.to(device), labels.to(device), mask if mask is None else mask.to(device)
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + micro * world + rank)
        rows, cols, targets, valid = select_windows(labels.cpu(), cfg.model.n, cfg.windows_per_sequence, g, segments)
        rows, cols, targets, valid = rows.to(device), cols.to(device), targets.to(device), valid.to(device)
        with accelerator.accumulate(model):
            params = model(ids, mask, rows, cols, segments)  # through the prepared (DDP) model: gradients are all-reduced
            nll, per_offset = window_loss(params, targets, valid, rows, ids.shape[0], cfg.gamma)
            kl = kl_loss(mtpc, params, targets, valid, ids, rows, cols) if cfg.kl_weight else nll.new_zeros(())
            loss = nll + cfg.kl_weight * kl
            skipped = backward_step(loss)
        micro += 1
        window.add(loss=loss, nll=nll, kl=kl, nll_per_offset=per_offset)
        window.count(skipped_steps=skipped, bytes=(labels != IGNORE).sum())
        if not accelerator.sync_gradients:
            continue
        step += 1
        bar.update(1)
        if step % cfg.log_every == 0 or step == cfg.max_steps:
            means, totals, seconds = window.reduce()
            bytes_seen += int(totals["bytes"])
            result = {"step": step, **means, "nll_per_offset": [round(v, 4) for v in means["nll_per_offset"]],
                      "lr": scheduler.get_last_lr()[0], "assistant_bytes_per_s": totals["bytes"] / seconds,
                      "bytes_seen": bytes_seen, "skipped_steps": int(totals["skipped_steps"]),
                      "epoch": round(micro * world * cfg.batch_size / len(train), 4)}
            metrics.write(result)
            bar.set_postfix(loss=f"{result['loss']:.3f}", nll1=f"{result['nll_per_offset'][0]:.2f}")
        if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.max_steps) and held:
            # ZeRO-3: every process runs the same held-out sequences (its forwards gather the split
            # weights); which forwards run depends on the data only, so they match one for one
            if engine.evaluates_here(accelerator):
                t0 = time.perf_counter()
                with accelerator.autocast():  # as in training (a half-precision backbone needs it)
                    result["tf_acceptance"] = teacher_forced_acceptance(mtpc, held, tokenizer.pad_token_id,
                                                                        cfg.eval_sequences, device)
                metrics.write({"step": step, "tf_acceptance": result["tf_acceptance"],
                               "eval_seconds": time.perf_counter() - t0})
                log(f"[eval] step {step}: teacher-forced acceptance {result['tf_acceptance']:.3f} bytes/cycle "
                    "(greedy window)")
                window.exclude(time.perf_counter() - t0)
            accelerator.wait_for_everyone()  # the others wait here
        if step % cfg.save_every == 0 or step == cfg.max_steps:
            save_checkpoint(accelerator, model, optimizer, cfg, step,
                            {"micro_step": micro, "bytes_seen": bytes_seen},
                            functools.partial(METHODS["mtpc"].save_head, mtpc, base_model=cfg.backbone))
    bar.close()
    if accelerator.is_main_process and metrics.path.is_file():
        write_training_plot(metrics.path, Path(cfg.output_dir) / "metrics.png")
    del model  # see engine.finish
    engine.finish(accelerator)
    return result


if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a stuck run: `kill -USR1 PID` prints its stacks
    run_script(main)
