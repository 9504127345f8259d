"""Files written in one step: a reader sees the old file or the new one, never a part (heads,
checkpoints, metrics, results, the docs' tables)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def replacing(path) -> Iterator[Path]:
    """A temporary path beside `path` to write to; when the block ends without an error it
    replaces `path` in one step (os.replace: a reader sees the old file or the new one, never a
    part), otherwise it is removed and `path` is left as it was. A replaced file keeps its
    permissions."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        if path.exists():
            os.chmod(tmp, path.stat().st_mode & 0o777)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_atomic(path, data: str | bytes) -> None:
    """Write `data` to `path` through `replacing`."""
    with replacing(path) as tmp:
        tmp.write_bytes(data) if isinstance(data, bytes) else tmp.write_text(data)
