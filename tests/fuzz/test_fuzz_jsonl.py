"""Fuzzing JSONL chat files through `mtpkit.data.chat.load_examples`: records of every format
(ShareGPT, OpenAI, Alpaca, turns, prompt/question) with line separators, NUL, lone surrogates,
non-string values and empty turns, written with and without ensure_ascii, among garbage lines
and invalid UTF-8. Each line is loaded (a record of a known format with text) or reported in the
LoadReport at its true line number (lines end at "\n" only); or the file is a one-line DataError."""

from __future__ import annotations

import gzip
import json
import re

from hypothesis import example, given
from hypothesis import strategies as st

from fuzzing import JUNK, NON_STRINGS, TEXT, Blob, fuzz, one_line
from mtpkit.data.chat import ANSWER_KEYS, ROLE_ALIASES, DataError, load_examples


# A generated line carries its status: good (a record of a known format with text: it must be
# loaded, as the messages generated with it), bad (it must be reported in the LoadReport at its
# line number), either (loaded or reported, not both), blank (may be skipped silently).

@st.composite
def turn_records(draw):
    key, role_key, text_key, roles = draw(st.sampled_from([
        ("conversations", "from", "value", ["human", "Human", "gpt", "GPT", "system", "user", "assistant"]),
        ("messages", "role", "content", ["user", "assistant", "system"])]))
    turns, status, msgs = [], "good", []
    for _ in range(draw(st.integers(0, 4))):
        if draw(st.integers(0, 9)) == 0:
            turns.append(draw(JUNK))  # not a turn object
            status = "bad"
            continue
        role = draw(st.one_of(st.sampled_from(roles), st.sampled_from(["", "robot", None, 5])))
        text = draw(st.one_of(TEXT, NON_STRINGS)) if draw(st.integers(0, 5)) == 0 else draw(TEXT)
        turns.append({role_key: role, text_key: text})
        mapped = ROLE_ALIASES.get(str(role).lower())
        if mapped is None or not isinstance(text, str):
            status = "bad"
        msgs.append({"role": mapped, "content": text})
    while msgs and msgs[0]["role"] == "assistant":  # a ShareGPT segment cut out of a conversation
        msgs.pop(0)
    users = [m["content"] for m in msgs if m["role"] == "user"]
    if status == "good" and not users:
        status = "bad"  # no user turn (or no turn at all)
    elif status == "good" and not users[0]:
        status = "either"  # only empty text
    container = draw(st.sampled_from(["list"] * 8 + ["str", "dict", "none"]))
    if container != "list":
        turns, status = {"str": "hello", "dict": {}, "none": None}[container], "bad"
    return {key: turns}, status, msgs


@st.composite
def alpaca_records(draw):
    instruction = draw(st.one_of(TEXT, NON_STRINGS)) if draw(st.integers(0, 4)) == 0 else draw(TEXT)
    record = {"instruction": instruction}
    extras = {}
    for key in ("input", "output"):
        choice = draw(st.sampled_from(["absent", "text", "text", "junk"]))
        if choice != "absent":
            extras[key] = record[key] = draw(TEXT) if choice == "text" else draw(NON_STRINGS)
    if not isinstance(instruction, str):
        return record, "bad", None  # the prompt itself is not text
    if any(not isinstance(v, str) for v in extras.values()):
        return record, "either", None
    prompt = f"{instruction}\n\n{extras['input']}" if extras.get("input") else instruction
    msgs = [{"role": "user", "content": prompt}]
    if extras.get("output"):
        msgs.append({"role": "assistant", "content": extras["output"]})
    return record, ("good" if prompt else "either"), msgs


@st.composite
def turns_records(draw):
    turns = draw(st.one_of(st.lists(TEXT, max_size=3), st.lists(st.one_of(TEXT, NON_STRINGS), max_size=3), JUNK))
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
        return {"turns": turns}, "bad", None
    return {"turns": turns}, ("good" if turns[0] else "either"), [{"role": "user", "content": turns[0]}]


@st.composite
def prompt_records(draw):
    key = draw(st.sampled_from(["prompt", "question"]))
    prompt = draw(st.one_of(TEXT, NON_STRINGS)) if draw(st.integers(0, 4)) == 0 else draw(TEXT)
    record = {key: prompt}
    answer = None
    if draw(st.booleans()):
        answer = record[draw(st.sampled_from(ANSWER_KEYS))] = draw(st.one_of(TEXT, NON_STRINGS))
    if not isinstance(prompt, str):
        return record, "bad", None
    if answer is not None and not isinstance(answer, str):
        return record, "either", None
    msgs = [{"role": "user", "content": prompt}] + ([{"role": "assistant", "content": answer}] if answer else [])
    return record, ("good" if prompt else "either"), msgs


KNOWN_KEYS = {"conversations", "messages", "instruction", "turns", "prompt", "question", "id", "question_id",
              "task_id", "idx"}
JUNK_RECORDS = st.one_of(NON_STRINGS, TEXT,
                         st.dictionaries(TEXT.filter(lambda k: k not in KNOWN_KEYS), JUNK, max_size=3))


@st.composite
def record_lines(draw) -> tuple[bytes, str, list | None]:
    """One JSON line of a generated record: (bytes, status, expected messages)."""
    record, status, msgs = draw(st.one_of(turn_records(), alpaca_records(), turns_records(), prompt_records(),
                                          JUNK_RECORDS.map(lambda r: (r, "bad", None))))
    if isinstance(record, dict) and draw(st.booleans()):
        record["category"] = draw(st.one_of(TEXT, st.integers(0, 3)))
    line = json.dumps(record, ensure_ascii=draw(st.booleans()))
    line += draw(st.sampled_from(["", "", "\r", " ", "\t"]))  # CRLF files, trailing blanks
    data = line.encode("utf-8", "surrogatepass")  # ensure_ascii=False writes a lone surrogate as raw bytes
    if status == "good" and not _is_utf8(data):
        status = "bad"  # not UTF-8: cannot be a record
    return Blob(data), status, msgs


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@st.composite
def garbage_lines(draw) -> tuple[bytes, str, None]:
    kind = draw(st.sampled_from(["text", "bytes", "truncated", "deep", "bigint", "blank"]))
    if kind == "text":
        data = draw(TEXT).replace("\n", "").encode("utf-8", "surrogatepass")
    elif kind == "bytes":
        data = draw(st.binary(max_size=12)).replace(b"\n", b"")
    elif kind == "truncated":
        full = json.dumps({"prompt": draw(TEXT)}, ensure_ascii=draw(st.booleans()))
        data = full[: draw(st.integers(0, len(full) - 1))].encode("utf-8", "surrogatepass")
    elif kind == "deep":  # valid JSON nested deeper than Python's recursion limit
        depth = draw(st.sampled_from([2000, 50_000]))
        inner = "[" * depth + "]" * depth
        wrap = draw(st.booleans())
        data = f'{{"prompt": "x", "n": {inner}}}' if wrap else inner
        return Blob(data.encode()), ("either" if wrap else "bad"), None
    elif kind == "bigint":  # valid JSON that Python refuses (int longer than 4300 digits)
        return Blob(('{"prompt": "x", "n": 1' + "0" * 5000 + "}").encode()), "either", None
    else:
        return Blob(draw(st.sampled_from([b"", b" ", b"\r", b"\t \r"]))), "blank", None
    return Blob(data), _garbage_status(data), None


def _garbage_status(data: bytes) -> str:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return "bad"
    if not text.strip():
        return "blank"
    try:
        value = json.loads(text)
    except ValueError:
        return "bad"
    return "either" if isinstance(value, dict) else "bad"


LINES = st.lists(st.one_of(record_lines(), record_lines(), garbage_lines()), min_size=1, max_size=8)


def _check_load(path, lines, cap) -> None:
    """Load `path` (written from `lines`) and check every line is loaded or reported as its status says."""
    statuses = {n: (status, msgs) for n, (_, status, msgs) in enumerate(lines, start=1)}
    good = [n for n, (status, _) in statuses.items() if status == "good"]
    try:
        with cap():
            examples, report = load_examples(str(path))
    except DataError as e:
        one_line(e, path)
        assert not good, f"DataError although lines {good} are usable records: {e}"
        return
    loaded = {}
    for ex in examples:
        assert re.fullmatch(r"chat-\d+", ex.id), ex.id
        loaded[int(ex.id.split("-")[1])] = ex
    assert set(report.bad_lines) <= {str(path)}, report.bad_lines
    reported = {}
    for number, reason in report.bad_lines.get(str(path), []):
        assert "\n" not in reason, f"line {number}: reason spans lines: {reason!r}"
        assert number not in reported, f"line {number} reported twice"
        reported[number] = reason
    assert report.loaded == len(examples)
    assert set(loaded) | set(reported) <= set(statuses), (
        f"line numbers {sorted(set(loaded) | set(reported))} outside the file's {len(lines)} lines")
    for n, (status, msgs) in statuses.items():
        line = lines[n - 1][0]
        if status == "good":
            assert n in loaded, f"line {n} is a usable record but was not loaded ({reported.get(n)}): {line!r}"
            assert loaded[n].messages == msgs, f"line {n} loaded as {loaded[n].messages!r}, not {msgs!r}"
        if status == "bad":
            assert n in reported, f"line {n} is not a usable record but was neither refused nor reported: {line!r}"
        assert not (n in loaded and n in reported), f"line {n} was loaded and reported: {line!r}"


@fuzz(300)
@given(lines=LINES, final_newline=st.booleans(), gz=st.booleans())
@example(lines=[(Blob('{"prompt": "a\u2028b\u0085c"}'.encode()), "good",  # U+2028, U+0085 inside a record
                 [{"role": "user", "content": "a\u2028b\u0085c"}]),
                (Blob(b'{"turns": ["x"]}'), "good", [{"role": "user", "content": "x"}])],
         final_newline=True, gz=False)
@example(lines=[(Blob(b'{"prompt": "\xff"}'), "bad", None),  # one bad UTF-8 byte costs its line only
                (Blob(b'{"prompt": "y"}'), "good", [{"role": "user", "content": "y"}])],
         final_newline=False, gz=True)
def test_jsonl_lines_are_loaded_or_reported(scratch, cap, lines, final_newline, gz):
    folder = scratch
    data = b"\n".join(line for line, _, _ in lines) + (b"\n" if final_newline else b"")
    path = folder / ("chat.jsonl.gz" if gz else "chat.jsonl")
    path.write_bytes(gzip.compress(data, mtime=0) if gz else data)
    _check_load(path, lines, cap)


@fuzz(100)
@given(lines=st.lists(record_lines(), min_size=1, max_size=4), cut=st.integers(0, 200),
       flips=st.lists(st.tuples(st.integers(0, 200), st.integers(1, 255)), max_size=3))
def test_corrupt_gzip_jsonl_is_a_data_error(scratch, cap, lines, cut, flips):
    """A truncated or damaged .jsonl.gz (an interrupted download) loads what it can or is a
    DataError naming the file."""
    data = bytearray(gzip.compress(b"\n".join(line for line, _, _ in lines), mtime=0))
    for at, xor in flips:
        data[at % len(data)] ^= xor
    data = data[: max(1, len(data) - cut)]
    path = scratch / "chat.jsonl.gz"
    path.write_bytes(bytes(data))
    try:
        with cap():
            load_examples(str(path))
    except DataError as e:
        one_line(e, path)
