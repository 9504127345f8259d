"""The config every training recipe shares: the run's fields (`TrainArgs`; a head recipe's
`HeadTrainArgs` adds the backbone and data), their range rules, the parser (`--config YAML` and a
flag per field) and `parse_config` (defaults < YAML < flags, checked; `--print-config` and
`--print-configs` print the result instead of training). The recipes' own fields subclass these;
the machinery under them (types, YAML, rules) is `mtpkit.train.config`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Callable

import torch

from mtpkit.models.backbone import DEFAULT_BACKBONE, DEVICE_CHOICES, DTYPES
from mtpkit.train.config import NOT_EMPTY, Rule, above, add_config_args, at_least, between, check, one_of, resolve
from mtpkit.train.schedule import DECAYS


MIXED_PRECISION = ("auto", "no", "bf16", "fp16")
NONFINITE = ("stop", "skip")


@dataclasses.dataclass
class TrainArgs:
    """The fields every recipe has; a recipe's config extends it (and may change defaults)."""
    output_dir: str = "runs/train"
    """where config, metrics, checkpoints and tensorboard logs go"""
    max_steps: int = 1000
    """optimizer steps"""
    batch_size: int = 1
    """sequences per process per micro-step"""
    grad_accum: int = 1
    """micro-steps per optimizer step"""
    lr: float = 2e-4
    """peak AdamW learning rate"""
    warmup_steps: int = 0
    """linear warm-up steps"""
    decay_steps: int = 0
    """steps at the end of --max-steps over which the lr falls to --min-lr-ratio (0 = none, flat
    after the warm-up; -1 = every step after the warm-up)"""
    lr_decay: str = "linear"
    """shape of that fall: linear | cosine"""
    min_lr_ratio: float = 0.1
    """final learning rate as a fraction of --lr when the lr decays"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping (0 = off); under DeepSpeed this value replaces the config's gradient_clipping"""
    device: str = "auto"
    """where the run trains: auto = accelerate's choice (each process its own GPU, cuda:LOCAL_RANK,
    when CUDA is present, else the CPU) | cpu (also with GPUs; several CPU processes talk over
    gloo) | cuda | cuda:N (one process, on GPU N)"""
    dtype: str = "auto"
    """weight dtype of the frozen backbone: auto = bfloat16 on a GPU (float16 without bf16
    support), float32 on a CPU | float32 | bfloat16 | float16. The trained parameters (LoRA, heads,
    mask embeddings) stay float32 for the optimizer whatever this says. Not the same knob as
    --mixed-precision: --dtype sets what the weights are stored in (bfloat16 halves the backbone's
    memory), --mixed-precision autocasts the forward's matmuls; on a GPU both can be on"""
    mixed_precision: str = "auto"
    """auto | no | bf16 | fp16: autocast of the forward (its matmuls in that precision; fp16 adds
    loss scaling); the weights keep their dtype (--dtype for the backbone, float32 for the trained
    parameters). auto = the backbone's dtype when that is bfloat16 or float16 (the float32 trained
    parameters then meet half-precision activations, which needs autocast), else no"""
    seed: int = 0
    """seed of the init and the data order"""
    log_every: int = 1
    """steps between metric lines"""
    eval_every: int = 100
    """steps between evaluations (0 = none during training)"""
    save_every: int = 100
    """steps between checkpoints (the last step always saves)"""
    keep_checkpoints: int = 2
    """newest checkpoints kept on disk"""
    resume: str = ""
    """checkpoint folder to resume from, or `auto` for the newest in output_dir"""
    overwrite: bool = False
    """a fresh run into an output_dir that holds another run (checkpoint-N/, metrics.jsonl or
    config.yaml) deletes that run's files first (checkpoint-N/, config.yaml, metrics*.jsonl,
    metrics.png, tensorboard/, model/, eval.json; nothing else); without it such a run is refused
    unless --resume"""
    trust_checkpoint: bool = False
    """let --resume load a pickled state/ (DeepSpeed's, or accelerate's of the earlier layout),
    which can run code: only for checkpoints you wrote"""
    nonfinite: str = "stop"
    """on a non-finite loss or gradient norm: stop (the run ends with an error; no update, the last
    checkpoint intact) | skip (that optimizer step is skipped, its gradients dropped, counted as
    skipped_steps in metrics.jsonl)"""
    tensorboard: bool = False
    """also log to tensorboard (output_dir/tensorboard)"""
    dist_timeout: int = 1800
    """seconds a process waits on the others in a collective before failing (several processes)"""


@dataclasses.dataclass
class HeadTrainArgs(TrainArgs):
    """The fields of every recipe that trains a head on a frozen backbone (gated_lora, mtpc); a
    recipe's config extends it (and may change defaults)."""
    backbone: str = DEFAULT_BACKBONE
    """target model: a known name, a local HF folder or a Hub id"""
    data: str = "runs/distilled.jsonl"
    """training chat data (.jsonl of messages, e.g. data/distill.py output) or a `datasets` name;
    the assistant tokens carry the loss"""
    eval_data: str = "builtin:eval"
    """held-out chat data for the acceptance estimate every --eval-every steps: gated_lora reads its
    prompts (those also in --data left out), mtpc its answers ('' = every 20th record of --data, left
    out of training)"""
    max_length: int = 384
    """tokens per sequence (bytes on a byte-level backbone; gated_lora: before the masks are
    inserted); longer conversations are cut"""
    trust_remote_code: bool = False
    """allow custom model code (e.g. EvaByte's)"""


def argument_parser(cls, description: str, configs: str) -> argparse.ArgumentParser:
    """`--config YAML` and a flag per field of the config dataclass `cls` (its docstrings as help),
    and `--print-config`."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help=f"YAML config ({configs}); flags override it")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config (defaults < YAML < flags, checked) as one JSON line and exit "
                        "without training")
    p.add_argument("--print-configs", action="store_true",
                   help="alone: read a JSON list of argument lists from stdin and print, for each, its resolved "
                        "config as one JSON line, or {\"error\": the line the trainer would refuse it with}; exit "
                        "0. How eval/ablate.py reads all its variants in one process")
    add_config_args(p, cls)
    return p


TRAIN_RULES: tuple[Rule, ...] = (
    ("output_dir", *NOT_EMPTY),
    ("max_steps", *at_least(1)),
    ("batch_size", *at_least(1)),
    ("grad_accum", *at_least(1)),
    ("lr", *above(0)),
    ("warmup_steps", *at_least(0)),
    ("decay_steps", lambda v, cfg: v == -1 or 0 <= v <= cfg.max_steps, "-1 or in [0, --max-steps]"),
    ("lr_decay", *one_of(DECAYS)),
    ("min_lr_ratio", *between(0, 1)),
    ("weight_decay", *at_least(0)),
    ("max_grad_norm", *at_least(0)),
    ("device", lambda v, cfg: v in ("auto", "cpu", "cuda") or (v.startswith("cuda:") and v[5:].isdigit()),
     DEVICE_CHOICES),
    ("dtype", *one_of(("auto",) + tuple(DTYPES))),
    ("mixed_precision", *one_of(MIXED_PRECISION)),
    ("mixed_precision", lambda v, cfg: v != "fp16" or not trains_on_cpu(cfg),
     "auto, no or bf16 on a CPU (accelerate runs no float16 autocast there; it would silently run without)"),
    ("seed", *at_least(0)),
    ("log_every", *at_least(1)),
    ("eval_every", *at_least(0)),
    ("save_every", *at_least(1)),
    ("keep_checkpoints", *at_least(1)),
    ("nonfinite", *one_of(NONFINITE)),
    ("dist_timeout", *at_least(1)),
)
"""the rules of the shared fields (train/config.py `check`), in the order they are checked"""

HEAD_TRAIN_RULES: tuple[Rule, ...] = (
    ("backbone", *NOT_EMPTY),
    ("data", *NOT_EMPTY),
    ("max_length", *at_least(1)),
)
"""the rules of `HeadTrainArgs`' fields: a head recipe's RULES start with them"""


def trains_on_cpu(cfg: TrainArgs) -> bool:
    """Whether the run trains on a CPU: --device cpu, or auto where no GPU is visible."""
    return cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available())


def parse_config(parser: argparse.ArgumentParser, cls, argv=None, rules: tuple[Rule, ...] = (),
                 finish: Callable | None = None):
    """Defaults < YAML < flags, each value checked against its field's type, then TRAIN_RULES and
    the recipe's `rules` in order, then `finish(cfg)` (the recipe's own checks and the defaults that
    depend on other fields; a ValueError is an error); the first error is one line naming the file
    and key or the flag. With --print-config the result is printed as one JSON line and the
    process exits 0; `--print-configs` alone does it for each argument list of a JSON list on stdin
    (the one interface eval/ablate.py reads a trainer's settings through)."""
    if (sys.argv[1:] if argv is None else list(argv)) == ["--print-configs"]:
        for one in json.load(sys.stdin):
            try:
                print(json.dumps(dataclasses.asdict(_resolved(parser, cls, one, rules, finish, raising=True)[0])))
            except ValueError as e:
                print(json.dumps({"error": f"{parser.prog}: error: {e}"}))
        raise SystemExit(0)
    cfg, args = _resolved(parser, cls, argv, rules, finish)
    if args.print_config:
        print(json.dumps(dataclasses.asdict(cfg)))
        raise SystemExit(0)
    return cfg


def _resolved(parser, cls, argv, rules, finish, raising: bool = False):
    """(config, parsed flags) of `parse_config`; an error exits through `parser.error`, or with
    `raising` is a ValueError of its line."""
    if raising:
        def error(message):
            raise ValueError(message)
        parser.error = error
    args = parser.parse_args(argv)
    try:
        cfg = resolve(cls, args)
        check(cfg, TRAIN_RULES + tuple(rules))
        if finish is not None:
            finish(cfg)
    except ValueError as e:  # a ConfigError, or the recipe's own check
        parser.error(str(e))
    return cfg, args
