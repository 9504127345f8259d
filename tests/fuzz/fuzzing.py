"""Shared pieces of the fuzzing tests: generated inputs fed to the real readers and
parsers either work or fail with a one-line error of mtpkit's own; never another exception type
(a traceback), never a silent drop.

Every test is bounded (`fuzz(n)`: n examples), derandomized and keeps no example database, so a
run is the same on every machine and the folder costs well under a minute;
MTPKIT_FUZZ_SCALE=10 searches ten times as long (by hand, for new defects). Each call runs under a
memory cap (the `cap` fixture, conftest.py), so an input that would allocate without bound fails
fast with MemoryError (or torch's allocation RuntimeError) instead of swapping.
"""

from __future__ import annotations

import dataclasses
import os
import re

from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

FUZZ_SCALE = float(os.environ.get("MTPKIT_FUZZ_SCALE", "1"))


def fuzz(n: int):
    """Hypothesis settings of every test here: `n` examples (times MTPKIT_FUZZ_SCALE, for a longer
    search by hand), the same ones on every run."""
    return settings(max_examples=max(1, round(n * FUZZ_SCALE)), deadline=None, derandomize=True, database=None,
                    print_blob=False, phases=[Phase.explicit, Phase.generate, Phase.shrink],  # explain: seconds
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture,  # `cap`: one base per test
                                           HealthCheck.large_base_example, HealthCheck.filter_too_much])


def one_line(error: BaseException, *names) -> None:
    """An error a user reads: one line, naming each of `names` (the file, the spec)."""
    text = str(error)
    assert "\n" not in text, f"{type(error).__name__} message spans lines: {text!r}"
    for name in names:
        assert str(name) in text, f"{type(error).__name__} does not name {name}: {text!r}"


def vm_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


class Blob(bytes):
    """File bytes whose repr writes a long run of one byte as `b'[' * 5000` (falsifying examples
    stay readable)."""

    def __repr__(self) -> str:
        parts, at = [], 0
        for run in re.finditer(rb"(.)\1{19,}", self, re.DOTALL):
            parts += [repr(bytes(self[at:run.start()]))] if run.start() > at else []
            parts.append(f"{bytes(run.group(1))!r} * {len(run.group())}")
            at = run.end()
        parts += [repr(bytes(self[at:]))] if at < len(self) or not parts else []
        return " + ".join(parts)


@dataclasses.dataclass(frozen=True)
class Deep:
    """A JSON list nested `depth` deep (deeper than Python's recursion limit): `text()` is the spec."""
    depth: int

    def text(self) -> str:
        return "[" * self.depth + "]" * self.depth


# ------------------------------------------------------------------------------------ shared values

SEPARATORS = "\u2028\u2029\x85\r\x0b\x0c\x1c\x1d\x1e"  # str.splitlines() splits on each; JSONL on "\n" only
ODD = "\x00\ud800\udfff\ud83d\ufeff\n\t\"\\ "           # NUL, lone surrogates, BOM, JSON's escapes
CHARS = st.one_of(st.sampled_from(SEPARATORS + ODD), st.characters(codec="utf-8"))
TEXT = st.text(CHARS, max_size=8)
HUGE = [10**9, 2**31, 2**63, 10**30]
NON_STRINGS = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from(HUGE),
                        st.floats(allow_nan=False, allow_infinity=False, width=16),
                        st.lists(st.integers(0, 2), max_size=2),
                        st.dictionaries(st.sampled_from("ab"), st.integers(0, 2), max_size=1))
JUNK = st.one_of(NON_STRINGS, TEXT, st.sampled_from(["", "2", "-1", "2.5", "x", "nan", "[[0]]"]))
