"""Byte corpora for training a small byte-level backbone (`train/byte_lm.py`).

Documents come from two kinds of source, both available on every machine:
- chat records (self-distilled answers from `data/distill.py`, the built-in prompts), rendered
  with the byte tokenizer's ChatML template, so the model learns the chat format the bench uses;
- the Python standard library's own source, docstrings included (the only documentation
  Python ships everywhere), for volume.
Every `holdout_every`-th document of each source is held out for bits-per-byte evaluation.
Documents are joined into one id stream separated by the tokenizer's bos/endoftext token.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mtpkit.data.chat import DataError, load_examples

# stdlib folders that are tests, vendored code or generated data rather than library source
STDLIB_SKIP = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "turtledemo",
               "ensurepip", "__pycache__", "pydoc_data", "encodings"}


@dataclass
class ByteCorpus:
    """`train` / `heldout`: 1-D id streams per source name; `report`: what went in."""
    train: dict[str, torch.Tensor] = field(default_factory=dict)
    heldout: dict[str, torch.Tensor] = field(default_factory=dict)
    report: list[str] = field(default_factory=list)


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The standard library's .py files, sorted (deterministic across machines with one Python)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py")
                  if not STDLIB_SKIP.intersection(p.relative_to(root).parts[:-1]))


def stdlib_documents(max_bytes: int, root: Path | None = None) -> list[str]:
    """Source files until `max_bytes` UTF-8 bytes are collected (unreadable files are skipped)."""
    docs, total = [], 0
    for path in stdlib_files(root):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        docs.append(f"# {path.name}\n{text}")
        total += len(docs[-1].encode("utf-8"))
        if total >= max_bytes:
            break
    return docs


def chat_documents(source: str, tokenizer) -> tuple[list[str], str]:
    """Chat records rendered with the tokenizer's template (prompt-only records: the user turn)."""
    examples, report = load_examples(source)
    docs = [tokenizer.apply_chat_template(ex.messages, tokenize=False) for ex in examples]
    return docs, report.summary()


def encode_documents(tokenizer, docs: list[str]) -> torch.Tensor:
    """One id stream: every document preceded by the separator (bos) token."""
    sep = tokenizer.bos_token_id
    ids: list[int] = []
    for doc in docs:
        ids.append(sep)
        ids.extend(tokenizer(doc, add_special_tokens=False)["input_ids"])
    return torch.tensor(ids, dtype=torch.long)


def build_corpus(tokenizer, chat_sources: list[str], stdlib_bytes: int, holdout_every: int = 20,
                 chat_repeat: int = 1) -> ByteCorpus:
    """Train and held-out streams for every chat source and the stdlib.

    `chat_repeat` repeats the chat training stream (it is small next to the stdlib and is the
    text the bench prompts look like).
    """
    corpus = ByteCorpus()
    named: list[tuple[str, list[str]]] = []
    for source in chat_sources:
        docs, summary = chat_documents(source, tokenizer)
        named.append((f"chat:{Path(source).name if Path(source).exists() else source}", docs))
        corpus.report.append(f"{source}: {summary}")
    if stdlib_bytes > 0:
        docs = stdlib_documents(stdlib_bytes)
        named.append(("stdlib", docs))
        corpus.report.append(f"stdlib ({sysconfig.get_paths()['stdlib']}): {len(docs)} files")
    for name, docs in named:
        held = docs[holdout_every - 1::holdout_every] if len(docs) >= holdout_every else docs[-1:]
        held_ids = {id(d) for d in held}
        train = [d for d in docs if id(d) not in held_ids]
        if not train:
            raise DataError(f"{name}: too few documents to hold any out ({len(docs)})")
        stream = encode_documents(tokenizer, train)
        corpus.train[name] = stream.repeat(chat_repeat) if name.startswith("chat:") else stream
        corpus.heldout[name] = encode_documents(tokenizer, held)
    return corpus
