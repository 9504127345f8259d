"""The gated-LoRA ablations of Samragh et al. (arXiv:2507.11851) by one command: train every variant
with the same budget, bench them all in one interleaved run, measure the base model's own quality.

    python eval/ablate.py --recipe configs/gated_lora/smollm2-135m_k4.yaml \
        --variants full,no-lcm,no-sampler,basic,plain-lora,k2 --max-steps 300 \
        --data runs/distilled.jsonl --out runs/ablate [--launcher "accelerate launch --config_file
        configs/accelerate/cpu_ddp.yaml"] [--detach] [any train/gated_lora.py flag, e.g. --lr 1e-3]

1. Training. Each variant is `train/gated_lora.py --config RECIPE --data DATA --output-dir
   OUT/<variant> --max-steps N --resume auto <the variant's flags> <your extra flags>`, one after
   another, in a subprocess (prefixed by --launcher) logging to OUT/<variant>/train.log: the same
   recipe, data, steps and seed for all. Every variant's flags are first checked by the trainer's
   own parser (`train/gated_lora.py --print-configs`, before anything trains). Rerunning the same
   command skips a variant whose checkpoint-N/ is complete (it has trainer_state.json:
   train/checkpoints.py) and resumes an interrupted one; a variant folder trained with other
   flags is refused.
2. Variants (`VARIANTS`; `a+b` composes two, e.g. `no-lcm+k2`): `full` the recipe as is,
   `no-lcm`, `no-sampler`, `basic` (neither: Figure 7's baseline), `plain-lora` (LoRA on at every
   position, Figure 6), `kN` (N masks), `lcm-per-dim`, `train-masks`, `paper-step` (the
   paper's training step, against the recipe's cheaper one: tau per step and wall-clock).
3. One eval/bench.py run (OUT/bench/, log bench.log) over every head (checkpoint-N/head/): every
   variant quadratic; `full` and `basic` also linear; `full` also at k=2 if trained with k > 2 (the
   same head: mask i sees masks 1..i only). A plain-LoRA head is not lossless (its drafts are
   verified by the LoRA-changed model), so its outputs differ from AR: the table marks it. The
   bench is skipped when OUT/bench/results.json holds this exact bench command and nothing was
   trained in this run (delete OUT/bench to measure again).
4. Base-model quality (Sec. 3.1, Figure 6): the NTP cross-entropy on the assistant tokens of
   --quality-data (default: the training data, which the table then says) of the base model and
   of each variant's model (`GatedMTP.next_token_logits`: gated heads give the base's logits
   exactly, a plain LoRA its own), and the max |logit - base logit|.
5. The report (`mtpkit.eval.ablate_report`): OUT/ablation.json, OUT/ablation.md (the table in the
   order of the paper's figures, and the training curves), OUT/ablation.png and OUT/curves.png.
`--detach` starts the same command in the background (own session, output to OUT/ablate.log),
prints its PID and returns.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from mtpkit.data.chat import IGNORE, DataError, load_examples, tokenize_chat
from mtpkit.data.jsonl import read_jsonl
from mtpkit.eval.ablate_report import comparisons, curves, curves_markdown, markdown, write_curves, write_plot
from mtpkit.eval.report import timing_warnings
from mtpkit.models.backbone import DTYPE_CHOICES, DEVICE_CHOICES, load_backbone
from mtpkit.models.gated_lora import load_head
from mtpkit.models.atomic_write import write_atomic
from mtpkit.models.process import run_script

ROOT = Path(__file__).resolve().parents[1]
TRAIN_SCRIPT = ROOT / "train" / "gated_lora.py"
BENCH_SCRIPT = ROOT / "eval" / "bench.py"
TRAINER_STATE = "trainer_state.json"  # train/checkpoints.py: written last, marks a complete checkpoint

VARIANTS: dict[str, tuple[list[str], str]] = {
    "full": ([], "the recipe as is (sampler, LCM; decoded quadratic, linear and at k=2)"),
    "no-lcm": (["--lcm-weight", "0"], "no latent-consistency loss (Sec. 2.5)"),
    "no-sampler": (["--sampler", "0"], "no sampler head (Sec. 2.3)"),
    "basic": (["--sampler", "0", "--lcm-weight", "0"], "no sampler, no LCM: Figure 7's baseline (also decoded linear)"),
    "plain-lora": (["--gated", "0"], "LoRA on at every position, not only the masks (Figure 6; not lossless)"),
    "lcm-per-dim": (["--lcm", "l2_per_dim"], "the LCM distance per dimension"),
    "train-masks": (["--train-mask-embeds", "1"], "trainable mask embeddings"),
    "paper-step": (["--anchors", "1", "--cache-ntp", "0"],
                   "the paper's training step: a mask block after every answer token, one forward"),
}
"""variant name -> (train/gated_lora.py flags, what it ablates); `kN` (N masks) and `a+b` besides"""
K_VARIANT = re.compile(r"k([1-9]\d*)")
OWN_FLAGS = ("--config", "--output-dir", "--resume", "--overwrite")  # set by this script for every variant
RESOLVED_ENV = "MTPKIT_ABLATE_RESOLVED"
"""--detach hands its background process the variants' resolved configs in this variable
({"argvs": ..., "configs": ...}), so the trainer's parser is not started a second time."""


class AblateError(ValueError):
    """Bad input: one line naming the flag, exit 2, nothing trained."""


def fail(message: str, code: int = 2):
    print(f"ablate: {message}", file=sys.stderr)
    raise SystemExit(code)


def say(message: str) -> None:
    print(f"[ablate] {message}", flush=True)


def variant_flags(name: str) -> dict[str, str]:
    """`no-lcm+k2` -> {"--lcm-weight": "0", "--k": "2"}; AblateError for an unknown or contradictory name."""
    flags: dict[str, str] = {}
    for part in name.split("+"):
        match = K_VARIANT.fullmatch(part)
        if match:
            pairs = ["--k", match.group(1)]
        elif part in VARIANTS:
            pairs = VARIANTS[part][0]
        else:
            raise AblateError(f"--variants: unknown variant {part!r}; known: {', '.join(VARIANTS)}, kN (N masks), "
                              "and a+b to compose two")
        for flag, value in zip(pairs[::2], pairs[1::2]):
            if flags.get(flag, value) != value:
                raise AblateError(f"--variants {name}: its parts set {flag} to {flags[flag]} and {value}")
            flags[flag] = value
    return flags


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    """Our flags, and the rest (flags for train/gated_lora.py, given to every variant)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False,
                                epilog="variants:\n" + "\n".join(f"  {n:<12} {' '.join(f) or '(no flag)'}: {d}"
                                                                 for n, (f, d) in VARIANTS.items())
                                + "\n  kN           --k N: N mask tokens\n  a+b          both (e.g. no-lcm+k2)\n\n"
                                "Any other flag goes to train/gated_lora.py for every variant (e.g. --lr 1e-3).")
    p.add_argument("--recipe", required=True, help="train/gated_lora.py YAML config (configs/gated_lora/*.yaml)")
    p.add_argument("--variants", default="full,no-lcm,no-sampler,basic,plain-lora,k2",
                   help="comma-separated variants, trained in this order (default: %(default)s)")
    p.add_argument("--max-steps", type=int, default=None,
                   help="optimizer steps of every variant (default: the recipe's max_steps)")
    p.add_argument("--data", default=None, help="training chat data of every variant (default: the recipe's data)")
    p.add_argument("--out", default="runs/ablate",
                   help="output folder: <variant>/ (each run), bench/, ablation.{json,md,png} (default: %(default)s)")
    p.add_argument("--launcher", default="",
                   help="command that starts each training run, e.g. \"accelerate launch --config_file "
                        "configs/accelerate/cpu_ddp.yaml\" or \"torchrun --nproc_per_node 2\" (default: this python)")
    p.add_argument("--detach", action="store_true",
                   help="run the whole command in the background (own session, log OUT/ablate.log); print the PID")
    p.add_argument("--bench-data", nargs="+", default=["builtin:eval"],
                   help="prompts of the bench, files or builtin[:eval] (default: %(default)s)")
    p.add_argument("--limit", type=int, default=20,
                   help="first N prompts of each --bench-data source (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=128,
                   help="tokens generated per bench prompt (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3,
                   help="bench rounds; timings are medians with their spread (default: %(default)s)")
    p.add_argument("--bench-args", default="", help="more eval/bench.py flags, one string (e.g. \"--linear onednn\")")
    p.add_argument("--quality-data", default=None,
                   help="chat records with assistant answers for the NTP cross-entropy (default: the training data, "
                        "marked as such in the table)")
    p.add_argument("--quality-limit", type=int, default=32,
                   help="records of --quality-data measured (default: %(default)s)")
    p.add_argument("--device", default=None, metavar=DEVICE_CHOICES,
                   help="given: passed to training, the bench and the quality measurement; not given: training "
                        "follows the recipe, the rest `auto` (CUDA when present)")
    p.add_argument("--dtype", default=None, metavar="|".join(DTYPE_CHOICES),
                   help="the backbone's dtype, passed on like --device (default: the recipe's / auto)")
    p.error = fail  # argparse's own errors too: one line, exit 2
    args, extras = p.parse_known_args(argv)
    try:
        check_args(args, extras)
    except AblateError as e:
        fail(str(e))
    return args, extras


def check_args(args: argparse.Namespace, extras: list[str]) -> None:
    if not Path(args.recipe).is_file():
        raise AblateError(f"--recipe {args.recipe}: no such file")
    if args.max_steps is not None and args.max_steps < 1:
        raise AblateError(f"--max-steps must be >= 1, got {args.max_steps}")
    for flag in ("limit", "max_new_tokens", "rounds", "quality_limit"):
        if getattr(args, flag) < 1:
            raise AblateError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if "," in args.out:
        raise AblateError(f"--out {args.out}: no commas (head paths go into the bench's method specs)")
    if args.quality_data and not args.quality_data.startswith("builtin") and not Path(args.quality_data).exists():
        raise AblateError(f"--quality-data {args.quality_data}: no such file")
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    if not names or len(set(names)) != len(names):
        raise AblateError(f"--variants {args.variants!r}: give distinct names, comma-separated")
    args.names = names
    args.flags = {n: variant_flags(n) for n in names}
    given = {e.split("=", 1)[0] for e in extras if e.startswith("--")}
    for flag in OWN_FLAGS:
        if flag in given:
            raise AblateError(f"{flag}: set by eval/ablate.py for every variant (use --recipe / --out)")
    for name, flags in args.flags.items():
        clash = sorted(given & set(flags))
        if clash:
            raise AblateError(f"{clash[0]}: variant {name} sets it; a flag given to every variant would erase the "
                              "ablation")


def train_argv(args, extras: list[str], name: str) -> list[str]:
    argv = ["--config", args.recipe, "--output-dir", str(Path(args.out) / name), "--resume", "auto"]
    for flag in ("data", "max_steps", "device", "dtype"):
        if getattr(args, flag) is not None:
            argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    return argv + [x for pair in args.flags[name].items() for x in pair] + extras


def resolve(argvs: dict[str, list[str]]) -> dict[str, dict]:
    """Each variant's resolved trainer config, read through the trainer's one interface for it,
    `python train/gated_lora.py --print-configs` (every variant's argument list in, one JSON line
    each out, one process; eval/ may not import train/,
    tests/test_package_direction.py, and the trainer's own parser is the one authority on its
    flags); the first variant it refuses exits 2 with the trainer's line. A --detach run's
    background process takes the configs its foreground resolved for the same trainer command
    lines."""
    handed = json.loads(os.environ.pop(RESOLVED_ENV, "") or "{}")
    if handed.get("argvs") == argvs:
        say("the variants' configs as resolved before detaching")
        return handed["configs"]
    proc = subprocess.run([sys.executable, str(TRAIN_SCRIPT), "--print-configs"], capture_output=True, text=True,
                          input=json.dumps(list(argvs.values())))
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or len(lines) < len(argvs):
        fail(f"could not read train/gated_lora.py's flags:\n{proc.stderr[-2000:]}", code=1)
    configs = {}
    for (name, argv), line in zip(argvs.items(), lines[-len(argvs):]):
        config = json.loads(line)
        if set(config) == {"error"}:
            fail(f"variant {name}: train/gated_lora.py refuses {shlex.join(argv)}: {config['error']}")
        configs[name] = config
    return configs


def final_checkpoint(out: Path, steps: int) -> Path:
    return out / f"checkpoint-{steps}"


def budget_free(argv: list[str]) -> list[str]:
    """The trainer flags without --max-steps: what a variant folder must have been trained with
    (a longer budget resumes it)."""
    return [a for i, a in enumerate(argv) if a != "--max-steps" and (i == 0 or argv[i - 1] != "--max-steps")]


def check_folder(out: Path, argv: list[str], steps: int) -> None:
    """Refuse (exit 2) a variant folder trained with other flags, or past `steps`."""
    recorded = out / "ablate_args.json"
    if recorded.is_file() and json.loads(recorded.read_text()) != budget_free(argv):
        fail(f"--out: {out} was trained with other flags ({shlex.join(json.loads(recorded.read_text()))}; now "
             f"{shlex.join(budget_free(argv))}); use another --out, or delete that folder")
    done = [p.parent.name.removeprefix("checkpoint-") for p in out.glob(f"checkpoint-*/{TRAINER_STATE}")]
    last = max((int(n) for n in done if n.isdigit()), default=0)
    if last > steps and not (final_checkpoint(out, steps) / TRAINER_STATE).is_file():
        fail(f"--max-steps {steps}: {out} holds a longer run (checkpoint-{last}); "
             f"use another --out or --max-steps {last}")


def train(name: str, argv: list[str], out: Path, steps: int, launcher: list[str], poll_s: float = 60.0) -> str:
    """Train one variant to `steps` (resuming it); 'skipped' if its final checkpoint is complete."""
    if (final_checkpoint(out, steps) / TRAINER_STATE).is_file():
        say(f"{name}: skipped, {final_checkpoint(out, steps)} is complete")
        return "skipped"
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "ablate_args.json", json.dumps(budget_free(argv)))
    cmd = launcher + [str(TRAIN_SCRIPT), *argv]
    log_path = out / "train.log"
    started = time.time()
    with open(log_path, "a") as log:
        log.write(f"\n# {datetime.datetime.now().isoformat(timespec='seconds')} {shlex.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        while proc.poll() is None:
            try:
                proc.wait(timeout=poll_s)
            except subprocess.TimeoutExpired:
                say(f"{name}: step {last_step(out / 'metrics.jsonl')}/{steps} ({time.time() - started:.0f} s)")
    if proc.returncode != 0:
        tail = "\n".join(log_path.read_text().splitlines()[-15:])
        fail(f"variant {name}: training failed (exit {proc.returncode}); the end of {log_path}:\n{tail}", code=1)
    if not (final_checkpoint(out, steps) / TRAINER_STATE).is_file():
        fail(f"variant {name}: training ended without {final_checkpoint(out, steps)} (see {log_path})", code=1)
    say(f"{name}: trained to step {steps} in {time.time() - started:.0f} s")
    return "trained"


def last_step(metrics: Path) -> int:
    """The step of the last complete line of a run's metrics.jsonl; 0 before there is one."""
    try:
        lines = read_jsonl(metrics)
    except (OSError, DataError):
        return 0
    return next((line.value.get("step", 0) for line in reversed(lines) if isinstance(line.value, dict)), 0)


def decodings(name: str, cfg: dict) -> list[tuple[str, str]]:
    """(label, bench options) of every decoding this variant is benched with."""
    out = [("quadratic", "decoding=quadratic")]
    if name in ("full", "basic"):
        out.append(("linear", "decoding=linear"))
    if name == "full" and cfg["model"]["k"] > 2:
        out.append(("quadratic, k=2", "decoding=quadratic,k=2"))
    sampler = "" if cfg["model"]["sampler"] else ",sampler=0"
    return [(label, opts + sampler) for label, opts in out]


def run_bench(args, backbone: str, specs: list[str], fresh: bool) -> dict:
    folder = Path(args.out) / "bench"
    folder.mkdir(parents=True, exist_ok=True)
    results_path = folder / "results.json"
    cmd = [sys.executable, str(BENCH_SCRIPT), "--backbone", backbone, "--data", *args.bench_data,
           "--limit", str(args.limit), "--max-new-tokens", str(args.max_new_tokens), "--rounds", str(args.rounds),
           "--methods", "ar", *specs, "--out", str(results_path)]
    cmd += [x for flag in ("device", "dtype") if getattr(args, flag) for x in (f"--{flag}", getattr(args, flag))]
    cmd += shlex.split(args.bench_args)
    recorded = folder / "command.json"
    if not fresh and results_path.is_file() and recorded.is_file() and json.loads(recorded.read_text()) == cmd[1:]:
        say(f"bench: skipped, {results_path} holds this bench command (delete {folder} to measure again)")
        return json.loads(results_path.read_text())
    log_path = folder / "bench.log"
    say(f"bench: {len(specs)} head decodings + AR, {args.rounds} round(s) (log {log_path})")
    started = time.time()
    with open(log_path, "w") as log:
        log.write(f"# {shlex.join(cmd)}\n")
        log.flush()
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode
    if rc != 0:
        tail = "\n".join(log_path.read_text().splitlines()[-15:])
        fail(f"the bench failed (exit {rc}); the end of {log_path}:\n{tail}", code=1)
    write_atomic(recorded, json.dumps(cmd[1:]))
    say(f"bench: done in {time.time() - started:.0f} s")
    return json.loads(results_path.read_text())


@torch.no_grad()
def ntp_quality(backbone: str, heads: dict[str, Path], source: str, limit: int, max_length: int,
                device: str, dtype: str) -> dict:
    """NTP cross-entropy on the assistant tokens of `source` (logits at t predict labels[t + 1]) of
    the base model and of each head's model (`next_token_logits`), and each one's max |logit -
    base logit| (Sec. 3.1, Figure 6)."""
    base, tokenizer = load_backbone(backbone, dtype=dtype, device=device)
    examples, _ = load_examples(source, limit=limit)
    device = base.get_input_embeddings().weight.device
    seqs = []
    for ex in examples:
        feat = tokenize_chat(tokenizer, ex.messages, max_length=max_length)
        labels = torch.tensor(feat["labels"][1:], device=device)
        if (labels != IGNORE).any():
            seqs.append((torch.tensor([feat["input_ids"]], device=device), labels))
    if not seqs:
        raise DataError(f"{source}: no record with an assistant answer")
    tokens = sum(int((labels != IGNORE).sum()) for _, labels in seqs)

    def ce(logits, labels):  # [1, T, V], [T - 1] -> summed nats
        return float(F.cross_entropy(logits[0, :-1].float(), labels, ignore_index=IGNORE, reduction="sum"))

    base_ce = sum(ce(base(input_ids=ids).logits, labels) for ids, labels in seqs) / tokens
    out = {"data": source, "records": len(seqs), "tokens": tokens, "base_ce": base_ce, "variants": {}}
    for name, head in heads.items():
        mtp = load_head(head, copy.deepcopy(base)).to(device).eval()  # load_head changes its backbone in place
        total, diff = 0.0, 0.0
        for ids, labels in seqs:
            logits = mtp.next_token_logits(ids)  # [1, T, V]
            total += ce(logits, labels)
            diff = max(diff, float((logits.float() - base(input_ids=ids).logits.float()).abs().max()))
        out["variants"][name] = {"ce": total / tokens, "max_abs_logit_diff": diff}
        del mtp
    return out


def detach(argv: list[str], out: Path, argvs: dict[str, list[str]], configs: dict[str, dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "ablate.log"
    env = dict(os.environ, **{RESOLVED_ENV: json.dumps({"argvs": argvs, "configs": configs})})
    with open(log_path, "a") as log:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *[a for a in argv if a != "--detach"]],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=env)
    say(f"running in the background: PID {proc.pid}, log {log_path} (stop it and its training run: "
        f"kill -- -{proc.pid})")


def main(argv=None) -> dict | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, extras = parse_args(argv)
    out = Path(args.out)
    argvs = {name: train_argv(args, extras, name) for name in args.names}
    configs = resolve(argvs)  # every variant's flags checked before anything trains
    if args.detach:
        detach(argv, out, argvs, configs)
        return None
    steps = configs[args.names[0]]["max_steps"]
    backbones = {c["backbone"] for c in configs.values()}
    if len(backbones) > 1:
        fail(f"the variants train different backbones ({', '.join(sorted(backbones))})")
    backbone = backbones.pop()
    launcher = shlex.split(args.launcher) if args.launcher else [sys.executable]
    for name in args.names:
        check_folder(out / name, argvs[name], steps)
    status = {}
    for i, name in enumerate(args.names, 1):
        flags = shlex.join(f for pair in args.flags[name].items() for f in pair) or "the recipe as is"
        say(f"variant {i}/{len(args.names)} {name}: {flags} (log {out / name / 'train.log'})")
        status[name] = train(name, argvs[name], out / name, steps, launcher)

    heads = {name: final_checkpoint(out / name, steps) / "head" for name in args.names}
    rows, specs = {}, []
    for name in args.names:
        for label, opts in decodings(name, configs[name]):
            spec = f"gated_lora:head={heads[name]},{opts}"
            rows[(name, label)] = {"variant": name, "decoding": label, "spec": spec,
                                   "plain": not configs[name]["model"].get("gated", True)}
            specs.append(spec)
    results = run_bench(args, backbone, specs, fresh="trained" in status.values())
    for row in rows.values():
        row.update({k: results["methods"][row["spec"]].get(k) for k in
                    ("tau", "tokens_per_s", "speedup_vs_ar", "speedup_vs_ar_spread", "matches_ar")})

    source = args.quality_data or configs[args.names[0]]["data"]
    say(f"quality: NTP cross-entropy of the base and {len(heads)} variant(s) on {source}")
    try:
        quality = ntp_quality(backbone, heads, source, args.quality_limit, configs[args.names[0]]["max_length"],
                              args.device or "auto", args.dtype or "auto")
    except DataError as e:
        fail(f"--quality-data: {e}")
    quality["is_training_data"] = Path(source).resolve() == Path(configs[args.names[0]]["data"]).resolve()

    table = comparisons(configs, rows, quality)
    report = {"command": shlex.join(["python", "eval/ablate.py", *argv]), "recipe": args.recipe, "max_steps": steps,
              "data": configs[args.names[0]]["data"], "seed": configs[args.names[0]]["seed"], "backbone": backbone,
              "bench_data": args.bench_data, "bench_results": str(out / "bench" / "results.json"),
              "variants": {n: {"flags": args.flags[n], "train_args": argvs[n], "status": status[n],
                               "head": str(heads[n]),
                               "gated": configs[n]["model"].get("gated", True), "settings": configs[n]}
                           for n in args.names},
              "rows": list(rows.values()),
              "quality": quality, "table": table, "warnings": timing_warnings(results)[0],
              "curves": curves(out, args.names)}
    text = markdown(report, table, results) + "\n".join(curves_markdown(report["curves"])) + "\n"
    write_atomic(out / "ablation.json", json.dumps(report, indent=1))
    write_atomic(out / "ablation.md", text)
    write_plot(table, results, out / "ablation.png")
    write_curves(report["curves"], out / "curves.png")
    print(text)
    say(f"wrote {out / 'ablation.json'}, {out / 'ablation.md'}, {out / 'ablation.png'}, {out / 'curves.png'}")
    return report


if __name__ == "__main__":
    run_script(main)
