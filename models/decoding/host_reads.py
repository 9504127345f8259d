"""Counting a decode's host reads and host-to-device copies, step by step.

On a GPU every read of a device tensor to the host (`.item()`, `.tolist()`, `bool()`, `int()`,
`.cpu()`, `.numpy()`, `nonzero`, `torch.equal`, ...) makes the host wait for the device, so the
reads a step makes bound how far the host can run ahead. `counting_reads` counts every such
call while it is open (reads of CPU tensors included: on a CPU the count bounds the real syncs
from above) and splits the count at each `drafter.propose`, i.e. per decoding step; with the
target, also its uploads (`Target.upload`). The bench reports the mean per step
(`host_reads_step`); tests/eval/test_host_syncs.py bounds it per method.
"""

from __future__ import annotations

import contextlib

import torch

TENSOR_READS = ("item", "tolist", "__bool__", "__int__", "__index__", "__float__", "__complex__", "cpu", "numpy",
                "__array__", "nonzero")
TORCH_READS = ("equal", "allclose", "nonzero", "is_nonzero")


class Steps(list):
    """Reads per step (a list), and `uploads`: host-to-device copies per step."""
    uploads: list[int]


def _patched(owner, name, count):
    original = getattr(owner, name)

    def read(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)
    return original, read


@contextlib.contextmanager
def counting_reads(drafter, target=None):
    """Count every host read while decoding; the yielded `Steps` gets the reads of each step (a step
    starts at the drafter's `propose`) when the block ends, and with `target` its uploads."""
    marks, count, uploads = [], [0], []
    propose = drafter.propose

    def marked(tokens):
        marks.append(count[0])
        if target is not None:
            uploads.append(target.uploads)
        return propose(tokens)

    steps, restore = Steps(), []
    own = vars(drafter).get("propose")  # an instance's own propose, if it had one
    try:
        for owner, names in ((torch.Tensor, TENSOR_READS), (torch, TORCH_READS)):
            for name in names:
                original, read = _patched(owner, name, count)
                restore.append((owner, name, original))
                setattr(owner, name, read)
        drafter.propose = marked
        yield steps
        marks.append(count[0])
        if target is not None:
            uploads.append(target.uploads)
    finally:
        for owner, name, original in reversed(restore):
            setattr(owner, name, original)
        if own is None:
            del drafter.propose  # the class's method again
        else:
            drafter.propose = own
    steps += [b - a for a, b in zip(marks, marks[1:])]
    steps.uploads = [b - a for a, b in zip(uploads, uploads[1:])]
