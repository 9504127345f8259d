"""How every command-line script that imports torch ends (`run_script`)."""

from __future__ import annotations

import gc
import sys
from typing import Callable


def run_script(main: Callable[[], object], *, exit_status: bool = False) -> None:
    """Runs a command-line script's `main()`, then freezes the objects the garbage collector tracks
    (`gc.freeze`), so the interpreter's exit skips its cyclic collections over the ~0.4M objects
    that importing torch, transformers and DeepSpeed created: over a second per process on a
    2-core CPU, paid by every worker of a launcher.
    atexit handlers still run and objects outside reference cycles are still freed; only
    finalizers of objects in cycles are skipped at exit, which CPython does not promise to run
    anyway. With `exit_status`, main's return value is the process's exit status."""
    result = main()
    gc.freeze()
    if exit_status:
        sys.exit(result)
