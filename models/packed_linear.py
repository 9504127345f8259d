"""Decoding-time linear layers on oneDNN's prepacked fp32 kernel (CPU).

Why: speculative decoding feeds the target 2-16 tokens per step. On this project's CPUs
(AMD EPYC, torch's MKL build) `F.linear` on 2-5 rows costs 2-3x one row, so verifying a few
tokens eats the gain; oneDNN with a prepacked weight costs about the same for 1-5 rows, and
on one row it is faster for a large weight (SmolLM2's 49152 x 576 LM head: 6 ms against 13 ms)
but slower for a small one (its fixed cost per call is larger). So a `PackedLinear` sends one
row of a weight below `ONE_ROW_PACKED` elements to torch's `F.linear`, everything else to
oneDNN, and `pack_linears` leaves weights below `MIN_PACK` elements alone (per-call overhead
dominates both kernels there). `eval/bench.py --linear auto` (the default) runs every method,
plain AR included, on the packed target, and also AR on the stock one (`ar_stock`).

Exactness: with the weight packed for a batch of 4 rows (`PACK_ROWS`), a row's oneDNN result
does not depend on how many rows are computed with it (tested; packed for 1 row it does). A
single row of a small weight goes through `F.linear` instead and can differ from the oneDNN
result in the last bits, as torch's own 1-row and many-row kernels already differ. Greedy
decoding stays token for token equal to AR on the same packed target (tested).

Inference only: with gradients enabled, or a non-fp32/non-CPU input, a layer falls back to
`F.linear` on the same weight. A weight changed in place after packing is packed again.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

LINEARS = ("stock", "onednn", "auto")
PACK_ROWS = 4  # oneDNN picks its kernel by this batch hint; 4 gives row-invariant results
MIN_PACK = 1 << 16  # elements: smaller weights stay nn.Linear
ONE_ROW_PACKED = 1 << 22  # elements: one row of a smaller weight goes through F.linear


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def pack_rows(weight: torch.Tensor) -> torch.Tensor:
    """A [out, in] fp32 weight in oneDNN's layout for `packed_forward`."""
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)


def packed_forward(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] times a `pack_rows` weight (+ bias) -> [..., out]."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """An `nn.Linear` whose forward (no grad, fp32, CPU) runs oneDNN on a prepacked weight.

    Keeps the original `weight` Parameter (tied embeddings stay tied, state dicts unchanged)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.packed = None
        self.packed_version = -1

    def usable(self, x: torch.Tensor) -> bool:
        """Whether forward(x) takes the packed kernel (else it is F.linear)."""
        return (not torch.is_grad_enabled() and x.dtype == torch.float32 and x.device.type == "cpu"
                and self.weight.dtype == torch.float32
                and (x.numel() > x.shape[-1] or self.weight.numel() >= ONE_ROW_PACKED))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.usable(x):
            return F.linear(x, self.weight, self.bias)
        if self.packed is None or self.weight._version != self.packed_version:
            self.packed, self.packed_version = pack_rows(self.weight.detach()), self.weight._version
        return packed_forward(x, self.packed, None if self.bias is None else self.bias.detach())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, onednn"


def pack_linears(model: nn.Module, linear: str = "auto", min_numel: int | None = None) -> int:
    """Swap every fp32 CPU `nn.Linear` of `model` with at least `min_numel` weights (in place)
    for a `PackedLinear` (default `MIN_PACK`); returns how many.

    linear: `onednn` (error if unavailable), `auto` (oneDNN where available, else nothing),
    `stock` (nothing). Apply it after every adapter is attached (peft wraps nn.Linear only)."""
    if linear not in LINEARS:
        raise ValueError(f"linear must be one of {LINEARS}, got {linear!r}")
    if linear == "stock" or (linear == "auto" and not onednn_available()):
        return 0
    if not onednn_available():
        raise ValueError("linear=onednn: this torch build has no oneDNN (torch.backends.mkldnn)")
    min_numel = MIN_PACK if min_numel is None else min_numel
    swaps = [(name, m) for name, m in model.named_modules()
             if type(m) is nn.Linear and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"
             and m.weight.numel() >= min_numel]
    for name, module in swaps:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, PackedLinear(module))
    return len(swaps)
