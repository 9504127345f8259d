"""Run a head: generate a reply to one prompt or chat through the one speculative decoder, the text
streamed as each verifier step is accepted, then tau and tokens/s.

    python eval/generate.py --head runs/demo/export --prompt "Write a function that adds two numbers."
    python eval/generate.py --method probe:bc=10 --chat chat.json --temperature 0.7
    python eval/generate.py --method ar --prompt "..."          # plain autoregressive, the same loop

`--head` takes a folder written by train/export.py (or a checkpoint's head/); its method is read
from its mtpkit_config.json. `--method` takes any eval/bench.py method spec instead (`ar`,
`pld`, `probe:bc=10`, `gated_lora:head=DIR,decoding=linear,k=1`, `mtpc:head=DIR,tree=...`).
Greedy decoding (the default) returns exactly the backbone's own greedy reply; with
`--temperature` > 0 the reply follows the backbone's sampling distribution. From Python:

    from mtpkit.models.backbone import load_backbone
    from mtpkit.eval.generate import Runner
    model, tokenizer = load_backbone("smollm2-135m-instruct")
    runner = Runner(model, tokenizer, "runs/demo/export")   # the head loads once
    reply = runner.generate(prompt="Write a haiku.", on_text=lambda s: print(s, end="", flush=True))
    print(reply.tau, reply.tokens_per_s)

(`mtpkit.models.generate` is the other generator: plain batched AR, what self-distillation runs.)
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from mtpkit.data.chat import generation_prompt_ids, to_messages
from mtpkit.models.decoding.decoder import DecodeResult, Target, decode
from mtpkit.models.decoding.step import STEP_CHOICES, resolve_step
from mtpkit.eval.specs import build_drafter
from mtpkit.models.backbone import (DEFAULT_BACKBONE, BackboneError, add_device_args, eos_token_ids, load_backbone,
                                    resolve_device, resolve_dtype)
from mtpkit.models.head_folder import head_folder, read_head_config
from mtpkit.models.process import run_script
from mtpkit.models.kernel_plan import pack_targets
from mtpkit.models.packed_linear import LINEARS


@dataclass
class Reply:
    """One generated reply and how the decoder got there."""
    text: str
    tokens: list[int]
    result: DecodeResult

    @property
    def tau(self) -> float:
        """tokens per target call (1.0 for plain AR)"""
        return self.result.tau

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / max(self.result.seconds, 1e-9)


def head_spec(folder) -> str:
    """A head folder -> `METHOD:head=FOLDER`, its method read from its mtpkit_config.json; a path
    that is not a head folder is a FileNotFoundError or ValueError (one line)."""
    folder = head_folder(Path(folder).expanduser())
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such folder (a head folder written by train/export.py)")
    return f"{read_head_config(folder)['method']}:head={folder}"


def method_spec(head_or_spec: str) -> str:
    """A head folder (`head_spec`), or a method spec as it is."""
    return head_spec(head_or_spec) if Path(head_or_spec).expanduser().is_dir() else head_or_spec


def decoder_drafter(spec: str):
    """`build_drafter(spec)`, refusing (ValueError) a baseline that has no drafter."""
    drafter = build_drafter(spec)
    if drafter is None:
        raise ValueError(f"{spec}: a baseline of eval/bench.py (transformers' generate), not a method of the "
                         "mtpkit decoder; use ar")
    return drafter


class TextStream:
    """Token ids in, the text they add out: the whole reply is decoded again at each step and the
    new part passed on, all but a trailing incomplete character (a byte-level token can split a
    UTF-8 character), which waits for the next step or `finish`."""

    def __init__(self, tokenizer, on_text: Callable[[str], None]):
        self.tokenizer, self.on_text = tokenizer, on_text
        self.ids: list[int] = []
        self.shown = 0  # characters passed on so far

    def __call__(self, new_ids: list[int]) -> None:
        self.ids += new_ids
        self._show(final=False)

    def finish(self) -> None:
        self._show(final=True)

    def _show(self, final: bool) -> None:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if not final:  # a character cut in half decodes as U+FFFD: it waits for its other bytes
            text = text.rstrip("\ufffd")
        if len(text) > self.shown:
            self.on_text(text[self.shown:])
            self.shown = len(text)


class Runner:
    """A backbone with one method's drafter attached, ready to generate many replies: the head
    (if any) loads once, and the target's products are packed as the bench packs them (`linear`:
    see eval/bench.py --linear; `model` is changed in place). `drafter`: the method's drafter
    built already by `decoder_drafter` (as the CLI does, to check it before the model loads).
    `step`: how decoding steps run (eval/bench.py --step; auto = CUDA graphs on CUDA, plain AR's
    compiled first; on a CPU compiled steps where this machine measured them faster, `mtpkit.models.decoding.step_plan`), `max_len`: a static cache's positions (prompt + reply) for the fixed-step modes."""

    def __init__(self, model, tokenizer, method: str = "ar", linear: str = "stock", fuse: bool = True,
                 drafter=None, step: str = "auto", max_len: int = 4096):
        self.spec, self.tokenizer = method_spec(method), tokenizer
        self.drafter = drafter if drafter is not None else decoder_drafter(self.spec)
        target_model, gate = self.drafter.adapt(model, {})
        pack_targets(model, [target_model] if target_model is not model else [], linear, fuse)
        step = resolve_step(step, model.get_input_embeddings().weight.device, model, self.drafter)
        self.target = Target(target_model, gate, step=step, max_len=max_len)
        self.eos = eos_token_ids(model, tokenizer)

    def generate(self, prompt: str | None = None, messages: list[dict] | None = None, max_new_tokens: int = 256,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                 on_text: Callable[[str], None] | None = None) -> Reply:
        """The reply to `prompt` (one user turn) or `messages` (OpenAI-style turns), through the
        backbone's chat template; `on_text` gets the text as each verifier step is accepted."""
        if (prompt is None) == (messages is None):
            raise ValueError("give a prompt or messages, not both")
        messages = [{"role": "user", "content": prompt}] if prompt is not None else messages
        ids = generation_prompt_ids(self.tokenizer, messages)
        stream = TextStream(self.tokenizer, on_text) if on_text is not None else None
        generator = torch.Generator(self.target.device).manual_seed(seed)
        result = decode(self.target, self.drafter, ids, max_new_tokens, temperature, top_p, self.eos, generator,
                        on_tokens=stream)
        if stream is not None:
            stream.finish()
        return Reply(self.tokenizer.decode(result.tokens, skip_special_tokens=True), result.tokens, result)


def generate(model, tokenizer, method: str = "ar", **kwargs) -> Reply:
    """One reply: `Runner(model, tokenizer, method).generate(**kwargs)` (keep a Runner for many)."""
    return Runner(model, tokenizer, method).generate(**kwargs)


def read_chat(path: str) -> list[dict]:
    """--chat: a JSON file of one conversation, in any record format mtpkit reads (a list of
    OpenAI-style turns, or one record: messages, conversations, instruction, prompt ...). A
    closing assistant turn is dropped: the reply written is that turn."""
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"--chat {path}: cannot read ({why})") from None
    try:
        messages = to_messages({"messages": value} if isinstance(value, list) else value)
    except (ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"--chat {path}: {e}") from None
    return messages[:-1] if messages[-1]["role"] == "assistant" else messages


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backbone", default=DEFAULT_BACKBONE,
                   help="the target model the head was trained on: a known name, a local folder or a Hub id "
                        "(default: %(default)s)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--head", help="a head folder (train/export.py output, or a checkpoint's head/)")
    which.add_argument("--method", default="ar",
                       help="an eval/bench.py method spec instead of --head, e.g. probe:bc=10 or "
                            "gated_lora:head=DIR,decoding=linear,k=1 (default: %(default)s, plain AR)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="one user turn, sent through the backbone's chat template")
    what.add_argument("--chat", help="a JSON file of a conversation (a list of {role, content} turns, or one "
                                     "record in any format mtpkit reads); the reply is the next assistant turn")
    p.add_argument("--max-new-tokens", type=int, default=256, help="the longest reply, in tokens (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (exactly the backbone's greedy reply); > 0 samples with speculative sampling, "
                        "exact in distribution (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling mass, with --temperature > 0 (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling (default: %(default)s)")
    p.add_argument("--linear", choices=LINEARS, default="auto",
                   help="the target's linear layers, as eval/bench.py --linear: auto = the kernel measured fastest "
                        "on this machine per row count (timed once, then cached), stock = torch's layers "
                        "(default: %(default)s)")
    p.add_argument("--step", choices=STEP_CHOICES, default="auto",
                   help="how decoding steps run, as eval/bench.py --step: auto = captured CUDA graphs on CUDA "
                        "(one per draft-tree shape, captured at first use; plain AR's step compiled first), on a CPU "
                        "compiled where this machine measured it faster, else eager; eager = dynamic shapes, "
                        "static / compile = fixed-shape steps, run eagerly or under torch.compile; graph / "
                        "compile_graph = captured, uncompiled or compiled (CUDA) (default: %(default)s)")
    p.add_argument("--max-len", type=int, default=4096,
                   help="with a fixed-step --step: the static cache's positions, prompt and reply together "
                        "(default: %(default)s)")
    p.add_argument("--trust-remote-code", action="store_true", help="let the backbone run its own modelling code")
    add_device_args(p)
    args = p.parse_args(argv)
    if args.max_new_tokens < 1:
        p.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.max_len < 2:
        p.error(f"--max-len must be >= 2, got {args.max_len}")
    if not args.temperature >= 0 or not 0 < args.top_p <= 1:
        p.error("--temperature must be >= 0 and --top-p in (0, 1]")
    return args


def main(argv=None) -> Reply:
    args = parse_args(argv)
    try:
        messages = read_chat(args.chat) if args.chat else [{"role": "user", "content": args.prompt}]
        spec = head_spec(args.head) if args.head else args.method
        drafter = decoder_drafter(spec)  # its options and head files checked before the backbone loads
        device = resolve_device(args.device)
        model, tokenizer = load_backbone(args.backbone, dtype=resolve_dtype(args.dtype, device),
                                         trust_remote_code=args.trust_remote_code, device=device)
        runner = Runner(model, tokenizer, spec, linear=args.linear, drafter=drafter, step=args.step,
                        max_len=args.max_len)
    except (ValueError, FileNotFoundError, BackboneError) as e:  # MethodError is a ValueError
        sys.exit(f"generate: {e}")
    try:
        reply = runner.generate(messages=messages, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                top_p=args.top_p, seed=args.seed, on_text=lambda s: print(s, end="", flush=True))
    except ValueError as e:  # e.g. a prompt and reply longer than a static cache's --max-len
        sys.exit(f"generate: {e}")
    print(flush=True)
    print(f"[generate] {runner.spec}: {len(reply.tokens)} tokens, tau {reply.tau:.2f} "
          f"({reply.result.target_calls} target calls), {reply.tokens_per_s:.1f} tokens/s", file=sys.stderr)
    return reply


if __name__ == "__main__":
    run_script(main)
