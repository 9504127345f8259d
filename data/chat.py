"""Chat records: read them, normalise every format to messages, tokenise with labels.

Record formats understood by `to_messages` (one per record; the first that matches wins):
- ShareGPT: `conversations` = [{"from": human|user|gpt|assistant|system, "value": ...}]
- OpenAI: `messages` = [{"role": user|assistant|system, "content": ...}]
- Alpaca: `instruction`, optional `input`, optional `output`
- Spec-Bench / MT-Bench: `turns` = [user turn, ...] (prompt-only), optional `category`
- prompt-only: `prompt` or `question`, with an optional answer in
  `answer` / `response` / `completion` / `output` / `canonical_solution`
Labels are -100 everywhere except on assistant tokens: the assistant's content and the
template's end-of-turn token (so the model learns to stop), never the role header.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mtpkit.data.jsonl import DataError, parse_jsonl, read_bytes

IGNORE = -100
ROLE_ALIASES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "model": "assistant",
                "system": "system"}
ANSWER_KEYS = ("answer", "response", "completion", "output", "canonical_solution")


@dataclass
class Example:
    """One normalised record: `messages` in OpenAI form plus where it came from."""
    id: str
    messages: list[dict]
    category: str = "default"
    source: str = ""


@dataclass
class LoadReport:
    """What loading skipped: `bad_lines` maps file -> [(line number, reason)]."""
    loaded: int = 0
    bad_lines: dict[str, list[tuple[int, str]]] = field(default_factory=dict)

    @property
    def skipped(self) -> int:
        return sum(len(v) for v in self.bad_lines.values())

    def summary(self) -> str:
        text = f"loaded {self.loaded} records"
        for path, bad in self.bad_lines.items():
            lines = ", ".join(str(n) for n, _ in bad[:20]) + (" ..." if len(bad) > 20 else "")
            text += f"; skipped {len(bad)} malformed in {path} (lines {lines}: {bad[0][1]})"
        return text


def to_messages(record: dict) -> list[dict]:
    """Normalise one record to [{"role", "content"}]; raises ValueError naming what is wrong."""
    if not isinstance(record, dict):
        raise ValueError(f"a record must be a JSON object, got {type(record).__name__}")
    turn_keys = next(((key, role, text) for key, role, text in
                      (("conversations", "from", "value"), ("messages", "role", "content")) if key in record), None)
    if turn_keys is not None:  # ShareGPT or OpenAI
        key, role_key, text_key = turn_keys
        msgs = []
        for turn in record[key]:
            role = ROLE_ALIASES.get(str(turn.get(role_key, "")).lower())
            if role is None or not isinstance(turn.get(text_key), str):
                raise ValueError(f"turn needs {role_key} in {sorted(ROLE_ALIASES)} and a string {text_key}: {turn!r:.80}")
            msgs.append({"role": role, "content": turn[text_key]})
    elif "instruction" in record:
        prompt = record["instruction"]
        if not isinstance(prompt, str) or not isinstance(record.get("input", ""), (str, type(None))):
            raise ValueError("`instruction` (and `input`, when given) must be strings")
        if record.get("input"):
            prompt = f"{prompt}\n\n{record['input']}"
        msgs = [{"role": "user", "content": prompt}]
        if record.get("output"):
            msgs.append({"role": "assistant", "content": record["output"]})
    elif "turns" in record:
        turns = record["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise ValueError("`turns` must be a non-empty list of strings")
        msgs = [{"role": "user", "content": turns[0]}]  # later turns need the model's own replies
    elif "prompt" in record or "question" in record:
        prompt = record.get("prompt", record.get("question"))
        msgs = [{"role": "user", "content": prompt}]
        answer = next((record[k] for k in ANSWER_KEYS if isinstance(record.get(k), str)), None)
        if answer:
            msgs.append({"role": "assistant", "content": answer})
    else:
        raise ValueError(f"unknown record format (keys {sorted(record)[:8]}); expected conversations, "
                         "messages, instruction, turns, prompt or question")
    if not msgs or not all(isinstance(m["content"], str) for m in msgs):
        raise ValueError("record has no text")
    # Drop leading assistant turns (ShareGPT segments cut out of a longer conversation).
    while msgs and msgs[0]["role"] == "assistant":
        msgs.pop(0)
    if not any(m["role"] == "user" for m in msgs):
        raise ValueError("record has no user turn")
    return msgs


def _record_id(record: dict, fallback: str) -> str:
    for key in ("id", "question_id", "task_id", "idx"):
        if key in record:
            return str(record[key])
    return fallback


def _read_local(path: Path, report: LoadReport) -> list[tuple[int, dict]]:
    """[(line number, record)] from a .jsonl(.gz) or a .json list, counting malformed lines
    (invalid JSON or UTF-8: see mtpkit.data.jsonl) in `report`; blank lines are passed over."""
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    try:
        data = read_bytes(path)
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e})") from e
    if path.name.endswith((".json", ".json.gz")) and data.lstrip().startswith(b"["):
        try:
            return list(enumerate(json.loads(data.decode("utf-8")), start=1))
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: cannot read ({e})") from e
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: not valid JSON at line {e.lineno}: {e.msg}") from e
    rows = []
    for line in parse_jsonl(data):
        if line.error is None:
            rows.append((line.number, line.value))
        elif not line.blank:
            report.bad_lines.setdefault(str(path), []).append((line.number, line.error))
    return rows


def load_examples(source: str, split: str = "train", limit: int | None = None) -> tuple[list[Example], LoadReport]:
    """Read a local .jsonl/.json(.gz) file, a built-in prompt set, or a `datasets` name.

    Built-in sets: `builtin` is prompts/builtin.jsonl (160 prompts, 40 per category);
    `builtin:eval` its first BUILTIN_EVAL_PER_CATEGORY prompts of each category; `builtin:train`
    the rest of builtin.jsonl followed by all of prompts/train.jsonl (400 more prompts, for
    self-distillation), so a demo can train on one and measure on the other, and
    `builtin:train --limit N` with N <= 120 reads only builtin.jsonl's prompts.
    Malformed records are skipped and counted in the report (file and line numbers).
    """
    report = LoadReport()
    if source.startswith("builtin"):
        rows, origin = _builtin_rows(source, report), str(builtin_prompts_path())
    elif (path := Path(source).expanduser()).suffix in (".jsonl", ".json", ".gz") or path.exists():
        origin = str(path)
        rows = [(origin, number, record) for number, record in _read_local(path, report)]
    else:
        origin = source
        rows = [(origin, number, record) for number, record in enumerate(_load_hub_dataset(source, split), start=1)]
    examples = []
    for file, number, record in rows:  # file: where the record came from (builtin:train reads two)
        try:
            msgs = to_messages(record)
        except (ValueError, AttributeError, TypeError) as e:
            report.bad_lines.setdefault(file, []).append((number, str(e)))
            continue
        stem = Path(file).name.split(".")[0]
        examples.append(Example(id=_record_id(record, f"{stem}-{number}"), messages=msgs,
                                category=str(record.get("category", "default")), source=file))
        if limit is not None and len(examples) >= limit:
            break
    report.loaded = len(examples)
    if not examples:
        raise DataError(f"{origin}: no usable records ({report.summary()})")
    return examples, report


def _load_hub_dataset(name: str, split: str):
    import datasets  # imported here: slow, and only needed for Hub names

    try:
        return datasets.load_dataset(name, split=split)
    except Exception as e:  # datasets raises many types; the message is what matters
        raise DataError(f"cannot load dataset {name!r} (split {split!r}): not a local file, and "
                        f"`datasets` failed ({type(e).__name__}: {e})") from e


# The built-in prompt sets. builtin.jsonl: 160 prompts, 40 per category (code, math, chat,
# summarisation); its first BUILTIN_EVAL_PER_CATEGORY of each category are `builtin:eval` and
# never trained on. train.jsonl: 400 more prompts (code 140, math 140, chat 70, summarisation 50)
# that only `builtin:train` reads, after builtin.jsonl's non-eval prompts.
BUILTIN_EVAL_PER_CATEGORY = 10
BUILTIN_PARTS = ("", "train", "eval")


def builtin_prompts_path() -> Path:
    """prompts/builtin.jsonl: the set `builtin` is, and `builtin:eval` / `builtin:train` split."""
    return Path(__file__).parent / "prompts" / "builtin.jsonl"


def builtin_train_prompts_path() -> Path:
    """prompts/train.jsonl: extra training prompts that `builtin:train` appends."""
    return Path(__file__).parent / "prompts" / "train.jsonl"


def _builtin_rows(source: str, report: LoadReport) -> list[tuple[str, int, dict]]:
    """(file, line number, record) of `builtin`, `builtin:eval` or `builtin:train`."""
    name, _, part = source.partition(":")
    if name != "builtin" or part not in BUILTIN_PARTS:
        raise DataError(f"unknown built-in prompt set {source!r}; use builtin, builtin:train or builtin:eval")
    path = builtin_prompts_path()
    rows, seen = [], {}
    for number, record in _read_local(path, report):
        if part:
            cat = record.get("category") if isinstance(record, dict) else None
            seen[cat] = seen.get(cat, 0) + 1
            if (seen[cat] <= BUILTIN_EVAL_PER_CATEGORY) != (part == "eval"):
                continue
        rows.append((str(path), number, record))
    if part == "train":
        extra = builtin_train_prompts_path()
        rows += [(str(extra), number, record) for number, record in _read_local(extra, report)]
    return rows


# --------------------------------------------------------------------------- tokenisation

def generation_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of the whole conversation followed by the assistant's generation prompt."""
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False,
                                              add_generation_prompt=True))


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of the conversation before its first assistant turn, ready for generation."""
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    return generation_prompt_ids(tokenizer, messages[:first])


def tokenize_chat(tokenizer, messages: list[dict], max_length: int | None = None) -> dict:
    """`input_ids` of the templated conversation and `labels` on assistant tokens only.

    Each assistant turn is located in characters, as the text between the template rendered
    up to its generation prompt and the template rendered up to the end of the turn (trailing
    whitespace after the end-of-turn token, ChatML's newline, excluded). Every token that
    overlaps that span is labelled: with BPE a token may straddle the role header and the
    content (e.g. "\n   " before indented code), and it carries content, so it is labelled.
    """
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True))
        upto = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not text.startswith(upto) or len(upto) < start:
            raise ValueError("the chat template is not prefix-stable; cannot locate assistant tokens")
        spans.append((start, len(upto.rstrip())))
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
    else:  # slow tokenizers give no offsets (EvaByte's byte tokenizer): spans through prefix encodings
        ids, offsets = tokenizer(text, add_special_tokens=False)["input_ids"], None
    labels = [IGNORE] * len(ids)
    if offsets is None:
        for start, end in spans:
            a, b = (_prefix_tokens(tokenizer, text, ids, cut) for cut in (start, end))
            labels[a:b] = ids[a:b]
    for j, (a, b) in enumerate(offsets or ()):
        if any(a < end and b > start for start, end in spans):
            labels[j] = ids[j]
    if max_length is not None:
        ids, labels = ids[:max_length], labels[:max_length]
    return {"input_ids": ids, "labels": labels}


def _prefix_tokens(tokenizer, text: str, ids: list[int], cut: int) -> int:
    """How many tokens of `ids` (the encoding of `text`) encode text[:cut], for a tokenizer without
    offsets. Exact where text[:cut] encodes to a prefix of `ids` (a byte tokenizer: one token per
    byte, specials whole); any other tokenizer is refused rather than mislabelled."""
    head = tokenizer(text[:cut], add_special_tokens=False)["input_ids"]
    if ids[: len(head)] != head:
        raise ValueError(f"{type(tokenizer).__name__} gives no offsets and does not encode the conversation "
                         f"prefix by prefix (character {cut}); cannot locate assistant tokens")
    return len(head)


def pack(features: list[dict], block_size: int) -> list[dict]:
    """Greedily pack tokenised examples into blocks of at most `block_size` tokens.

    Examples are never split; each block carries `position_ids` that restart at 0 for every
    example so that `collate` can build a block-diagonal causal mask (no cross-example attention).
    """
    blocks, current = [], {"input_ids": [], "labels": [], "position_ids": []}
    for feat in features:
        n = len(feat["input_ids"])
        if n > block_size:
            feat = {k: v[:block_size] for k, v in feat.items()}
            n = block_size
        if current["input_ids"] and len(current["input_ids"]) + n > block_size:
            blocks.append(current)
            current = {"input_ids": [], "labels": [], "position_ids": []}
        current["input_ids"] += feat["input_ids"]
        current["labels"] += feat["labels"]
        current["position_ids"] += list(range(n))
    if current["input_ids"]:
        blocks.append(current)
    return blocks


def collate(features: list[dict], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a batch. Packed features (with `position_ids`) get a 4D block-diagonal mask."""
    length = max(len(f["input_ids"]) for f in features)
    B = len(features)
    input_ids = torch.full((B, length), pad_token_id, dtype=torch.long)
    labels = torch.full((B, length), IGNORE, dtype=torch.long)
    attention_mask = torch.zeros(B, length, dtype=torch.long)
    for b, f in enumerate(features):
        n = len(f["input_ids"])
        input_ids[b, :n] = torch.tensor(f["input_ids"])
        labels[b, :n] = torch.tensor(f["labels"])
        attention_mask[b, :n] = 1
    batch = {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}
    if "position_ids" in features[0]:
        position_ids = torch.zeros(B, length, dtype=torch.long)
        for b, f in enumerate(features):
            position_ids[b, : len(f["position_ids"])] = torch.tensor(f["position_ids"])
        # document index: a new document starts wherever the position id restarts at 0
        doc = (position_ids == 0).long().cumsum(-1)  # [B, T]
        same_doc = doc[:, :, None] == doc[:, None, :]
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        allowed = same_doc & causal & attention_mask.bool()[:, None, :]
        batch["position_ids"] = position_ids
        batch["attention_mask"] = allowed[:, None]  # [B, 1, T, T] boolean, True = attend
    return batch
