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
does not depend on how many rows are computed with it (tested; packed for 1 row it does), on
the CPUs and widths seen so far up to 4096 inputs, but not on session 10's AMD EPYC for 1280 or
4096 inputs (any pack hint): there such rows can differ in the last bits with the row count. A
single row of a small weight goes through `F.linear` instead and can differ from the oneDNN
result in the last bits, as torch's own 1-row and many-row kernels already differ. Greedy
decoding stays token for token equal to AR on the same packed target (tested).

Sibling projections of one input (q/k/v, gate/up) are then fused into one product each
(`fuse_siblings`, on by default in `pack_linears`; see `SiblingGroup`).

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
        self.siblings: SiblingGroup | None = None  # set by `fuse_siblings`

    def usable(self, x: torch.Tensor) -> bool:
        """Whether forward(x) takes the packed kernel (else it is F.linear)."""
        return (not torch.is_grad_enabled() and x.dtype == torch.float32 and x.device.type == "cpu"
                and self.weight.dtype == torch.float32
                and (x.numel() > x.shape[-1] or self.weight.numel() >= ONE_ROW_PACKED))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.siblings is not None and self.siblings.usable(x):
            return self.siblings(x, self)
        if not self.usable(x):
            return F.linear(x, self.weight, self.bias)
        if self.packed is None or self.weight._version != self.packed_version:
            self.packed, self.packed_version = pack_rows(self.weight.detach()), self.weight._version
        return packed_forward(x, self.packed, None if self.bias is None else self.bias.detach())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, onednn"


def pack_linears(model: nn.Module, linear: str = "auto", min_numel: int | None = None, fuse: bool = True) -> int:
    """Swap every fp32 CPU `nn.Linear` of `model` with at least `min_numel` weights (in place)
    for a `PackedLinear` (default `MIN_PACK`); returns how many. With `fuse`, the packed sibling
    projections of one input are then computed as one product each (`fuse_siblings`).

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
    if fuse:
        fuse_siblings(model)
    return len(swaps)


# projections that read the same input, in the order the layer calls them (Llama, Mistral, Qwen,
# SmolLM: attention's q/k/v, the MLP's gate/up)
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _gated_parts(module: nn.Module):
    """(A^T, scaled B^T, gate) of a gated LoRA linear over a packed base (`GatedLoRALinear`), else None."""
    if all(hasattr(module, a) for a in ("At", "Bt", "gate", "base")) and isinstance(module.base, PackedLinear):
        return module.At, module.Bt, module.gate
    return None


class SiblingGroup:
    """Sibling projections of one input (q/k/v, gate/up) computed as ONE product on the stacked
    weights, each member returning its columns (a view). Inference only: a member falls back to
    its own forward with gradients, or on a non-fp32 or non-CPU input.

    Why: on this CPU a decoding forward of a few rows costs about the same per product whatever
    its width, so 7 products per layer cost visibly more than 4 (measured on SmolLM2-135M, 9 rows
    on a 200-token cache: 1.38x against 1.47x a 1-row forward; gated LoRA 1.66x against 1.89x;
    the 1-row forward unchanged). The first member called computes the product and keeps it for
    the others while they are called with the very same input tensor (same object and version).

    Exactness: oneDNN's packed product gives a column the same bits whatever other columns are
    stacked with it (tested), so fused outputs equal the unfused packed ones on rows that go
    through oneDNN. One row of a weight under `ONE_ROW_PACKED` goes through `F.linear` on the
    stacked weight, as a `PackedLinear` does on its own (last bits may differ from three products).

    Gated LoRA members (`GatedLoRALinear` over packed bases, one gate): the stacked weight is
    [W_1; ...; W_m; A_1; ...; A_m] and the gated rows get one addmm with the block-diagonal
    [B_1, ..., B_m] (the LoRA scaling folded in), so ungated rows are W x exactly."""

    def __init__(self, members: list[nn.Module]):
        gated = [_gated_parts(m) for m in members]
        self.gated = gated[0] is not None
        bases = [m.base if self.gated else m for m in members]
        self.bounds, start = [], 0
        for base in bases:
            self.bounds.append((start, start + base.out_features))
            start += base.out_features
        self.out_features = start
        self.bases = bases
        if self.gated:
            self.gate = gated[0][2]
            self.At = torch.cat([g[0] for g in gated], 1)  # [in, R]
            self.B = torch.zeros(self.At.shape[1], self.out_features, dtype=self.At.dtype)  # block-diagonal
            row = 0
            for (lo, hi), (_, Bt, _) in zip(self.bounds, gated):
                self.B[row: row + Bt.shape[0], lo:hi] = Bt
                row += Bt.shape[0]
        self.version = None
        self.input, self.input_version, self.output = None, -1, None
        for i, m in enumerate(members):
            m.siblings, m.sibling_index = self, i

    def usable(self, x: torch.Tensor) -> bool:
        return (not torch.is_grad_enabled() and x.dtype == torch.float32 and x.device.type == "cpu"
                and all(b.weight.dtype == torch.float32 for b in self.bases))

    def _pack(self) -> None:
        version = tuple(b.weight._version for b in self.bases)
        if version == self.version:
            return
        with torch.no_grad():
            self.weight = torch.cat([b.weight.detach() for b in self.bases])
            biases = [b.bias for b in self.bases]
            self.bias = None if all(b is None for b in biases) else torch.cat(
                [b.detach() if b is not None else self.weight.new_zeros(base.out_features)
                 for b, base in zip(biases, self.bases)])
            if self.gated:
                stacked = torch.cat([self.weight, self.At.t()])
                self.bias_stacked = None if self.bias is None else torch.cat(
                    [self.bias, self.bias.new_zeros(self.At.shape[1])])
                self.packed = pack_rows(stacked)
            else:
                self.packed = pack_rows(self.weight)
        self.version = version

    def _compute(self, x: torch.Tensor) -> torch.Tensor:
        self._pack()
        O = self.out_features
        if not self.gated:
            if x.numel() == x.shape[-1] and self.weight.numel() < ONE_ROW_PACKED:
                return F.linear(x, self.weight, self.bias)
            return packed_forward(x, self.packed, self.bias)
        both = packed_forward(x, self.packed, self.bias_stacked)
        gate = self.gate
        if gate.rows is None or not gate.rows.numel():
            return both[..., :O]
        if gate.span is not None and x.dim() == 3 and x.shape[0] == 1:
            s, e = gate.span
            both[0, s:e, :O].addmm_(both[0, s:e, O:], self.B)
            return both[..., :O]
        delta = gate.select(both[..., O:]) @ self.B
        return both[..., :O] + gate.scatter(delta, both[..., :O])

    def __call__(self, x: torch.Tensor, member: nn.Module) -> torch.Tensor:
        if self.input is not x or self.input_version != x._version:
            self.output = self._compute(x)
            self.input, self.input_version = x, x._version
        lo, hi = self.bounds[member.sibling_index]
        return self.output[..., lo:hi]


def fuse_siblings(model: nn.Module, groups=SIBLINGS) -> int:
    """Make every set of sibling projections of `model` (all packed linears, or all gated LoRA
    linears over packed bases sharing one gate) a `SiblingGroup`; returns how many groups."""
    count = 0
    for parent in model.modules():
        for names in groups:
            members = [getattr(parent, n, None) for n in names]
            if any(m is None for m in members):
                continue
            plain = all(type(m) is PackedLinear for m in members)
            gated = [_gated_parts(m) for m in members]
            if not plain and not (all(g is not None for g in gated) and len({id(g[2]) for g in gated}) == 1):
                continue
            in_features = {(m if plain else m.base).in_features for m in members}
            if len(in_features) != 1:
                continue
            SiblingGroup(members)
            count += 1
    return count
