"""JSONL files: the one line reader every mtpkit reader uses, and the check of an output path.

A line ends at b"\\n" only. `str.splitlines()` also ends lines at U+2028, U+2029, U+0085 and
\\x1c-\\x1e, which `json.dumps(ensure_ascii=False)` leaves raw inside strings: splitting on them
cuts a valid record in pieces and shifts every later line number. A bad line (invalid UTF-8 or
invalid JSON) costs only itself; the caller skips it and counts it by its true line number.
"""

from __future__ import annotations

import gzip
import json
import os
import stat
import zlib
from pathlib import Path
from typing import Any, NamedTuple


class DataError(ValueError):
    """A data file that cannot be read at all (missing, unreadable, empty), or an output path
    that cannot be written as a file. Its message is one line naming the file."""


class Line(NamedTuple):
    """One line of a JSONL file."""
    number: int
    """1-based line number in the file"""
    value: Any
    """the parsed JSON value; None where `error` is set"""
    raw: bytes
    """the line's bytes, b"\\n" included (absent only on a last line cut short)"""
    error: str | None
    """why the line could not be parsed ("blank line", "invalid UTF-8 ...", "invalid JSON: ...")"""

    @property
    def blank(self) -> bool:
        return not self.raw.strip()


def read_bytes(path) -> bytes:
    """The whole of a regular file, gunzipped for a `.gz` name. A non-regular file (a device,
    a FIFO) is refused with DataError before it is opened: read whole, /dev/zero never ends."""
    path = Path(path)
    if not stat.S_ISREG(os.stat(path).st_mode):  # FileNotFoundError (an OSError) when missing
        raise DataError(f"{path}: not a regular file")
    data = path.read_bytes()
    if path.suffix == ".gz":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as e:
            raise DataError(f"{path}: cannot read ({e})") from e
    return data


def parse_jsonl(data: bytes) -> list[Line]:
    """Every line of `data`, numbered from 1, blank and bad ones included (their `error` says
    why), so that `b"".join(line.raw ...) == data`. A last line without b"\\n" is returned too:
    whether it is a record or an interrupted write is the caller's call (`raw` tells)."""
    parts = data.split(b"\n")
    raws = [part + b"\n" for part in parts[:-1]] + ([parts[-1]] if parts[-1] else [])
    lines = []
    for number, raw in enumerate(raws, start=1):
        value, error = None, None
        if not raw.strip():
            error = "blank line"
        else:
            try:
                value = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                error = f"invalid UTF-8 (byte {e.start + 1} of the line)"
            except json.JSONDecodeError as e:
                error = f"invalid JSON: {e.msg}"
            except (ValueError, RecursionError) as e:  # an int past Python's digit limit, nesting past its stack
                error = f"invalid JSON: {type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"
        lines.append(Line(number, value, raw, error))
    return lines


def read_jsonl(path) -> list[Line]:
    """`parse_jsonl` of a .jsonl or .jsonl.gz file (see `read_bytes` for what it refuses)."""
    return parse_jsonl(read_bytes(path))


_KINDS = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISSOCK, "a socket"))


def check_output_file(path, flag: str) -> Path:
    """Refuse, before any work, an output path that cannot be written as a regular file: an
    existing folder, device, FIFO or socket, or a path below a file. Returns `path` as a Path;
    raises DataError, one line naming `flag` and the path. Missing folders above it are fine
    (the caller creates them); nothing is created here."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        mode = None
    if mode is not None:
        if stat.S_ISDIR(mode):
            raise DataError(f"{flag} {path} is a folder; give the file to write")
        if not stat.S_ISREG(mode):
            kind = next((name for test, name in _KINDS if test(mode)), "not a file")
            raise DataError(f"{flag} {path} is not a regular file ({kind}); give a file to write")
        return path
    for parent in path.parents:  # the nearest one that exists must be a folder
        if parent.is_dir():
            break
        if parent.exists():
            raise DataError(f"{flag} {path}: {parent} is a file, not a folder")
    return path
