"""The exact top-k of a large LM head's logits from a product with its bfloat16 copy (a CPU).

Why: drafters that rank tokens through the target's LM head W [V, d] outside the verifier's step
(the gated-LoRA sampler, y_i = argmax W MLP([E(y_{i-1}); z_i]) one mask after another; Medusa's
and Hydra's heads, one depth after another) pay a read of all of W per call on a CPU: as much
as the LM head of the verifier's step, once per speculation or depth. oneDNN's bf16
product reads half the bytes. Its logits are off by at most a bound per row, so only the rows
whose upper bound reaches the k-th best lower bound can be in the top k: those few are computed
again in float32 from W and ranked. The result is the top k of the float32 logits W h, as the
full product ranks them up to float32 rounding (the candidates are computed by another kernel,
so two logits within rounding of each other may swap, as torch's one-row and many-row kernels
already do).

The bound, per row v, with h_b = bf16(h), W_b = bf16(W), out = the bf16 product's output
(float32 accumulation, rounded to bf16), g = d 2^-24 (d float32 additions, in the screen and in
the reference):

    |W_v h - out_v| <= |W_v| (|h - h_b| + 3 g |h_b|) + |W_v - W_b,v| |h_b| + 2^-7 |out_v| + 1e-6

(Cauchy-Schwarz for the two input roundings; 2^-7 |out| covers the output's rounding to bf16).
"""

from __future__ import annotations

import torch
from torch import nn

from mtpkit.models.packed_linear import pack_rows, packable_dtypes, packed_forward

MIN_SCREEN = 1 << 22  # weights below this many elements: the plain product (the screen's own ops cost more)
MAX_SHARE = 8  # more candidates than V / MAX_SHARE (a near-flat distribution): the full float32 product


class ScreenedHead:
    """`topk(h, k)`: the indices of the k largest logits of `head(h)` [..., V] (a bias-free fp32
    linear on the CPU), via the bf16 screen above. `usable(head)` says whether it applies."""

    def __init__(self, head: nn.Module):
        self.head = head
        self.version = None

    @classmethod
    def of(cls, head: nn.Module, previous: "ScreenedHead | None" = None) -> "ScreenedHead | None":
        """The screen of `head` where it applies (`usable`), else None; `previous` when it already
        screens `head` (a drafter keeps its screen across prompts: the bf16 copy is made once)."""
        if previous is not None and previous.head is head:
            return previous
        return cls(head) if cls.usable(head) else None

    @staticmethod
    def usable(head: nn.Module, min_numel: int | None = None) -> bool:
        """A bias-free float32 CPU head of at least `min_numel` weights (default `MIN_SCREEN`), on a
        CPU with oneDNN's bf16 product."""
        w = getattr(head, "weight", None)
        min_numel = MIN_SCREEN if min_numel is None else min_numel
        return (w is not None and getattr(head, "bias", None) is None and w.dtype == torch.float32
                and w.device.type == "cpu" and w.numel() >= min_numel and torch.bfloat16 in packable_dtypes())

    def _prepare(self) -> None:
        w = self.head.weight
        if self.version == (id(w), w._version):
            return
        with torch.no_grad():
            w = w.detach()
            low = w.to(torch.bfloat16)
            self.weight = w
            self.packed = pack_rows(low)
            self.norm = w.norm(dim=1)  # [V] |W_v|
            self.drift = (w - low.float()).norm(dim=1)  # [V] |W_v - W_b,v|
        self.version = (id(self.head.weight), self.head.weight._version)

    @torch.no_grad()
    def topk(self, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """hidden [..., d] float32 -> [..., k] token indices, best first."""
        self._prepare()
        shape = hidden.shape[:-1]
        h = hidden.reshape(-1, hidden.shape[-1])  # [n, d]
        low = h.to(torch.bfloat16)
        out = packed_forward(low, self.packed, None).float()  # [n, V]
        low_norm = low.float().norm(dim=-1, keepdim=True)  # [n, 1]
        g = h.shape[-1] * 2.0 ** -24
        in_err = (h - low.float()).norm(dim=-1, keepdim=True) + 3 * g * low_norm  # [n, 1]
        bound = (self.norm * in_err).addcmul_(self.drift, low_norm).add_(out.abs(), alpha=2.0 ** -7).add_(1e-6)
        floor = (out - bound).topk(k, dim=-1).values[:, -1:]  # [n, 1] the k-th best lower bound
        columns = ((out + bound) >= floor).any(0).nonzero().squeeze(1)  # candidates of any row
        if columns.numel() * MAX_SHARE > out.shape[-1]:
            return self.head(h).topk(k, dim=-1).indices.reshape(*shape, k)
        exact = h @ self.weight.index_select(0, columns).t()  # [n, C] float32 logits of the candidates
        return columns[exact.topk(k, dim=-1).indices].reshape(*shape, k)
