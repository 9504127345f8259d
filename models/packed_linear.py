"""Decoding-time linear layers: each product on the kernel measured fastest for its row count.

Why: speculative decoding feeds the target 2-16 tokens per step, AR one. Which kernel is fastest
for a given number of rows depends on the machine (the CPU, its vector units, its caches, the
weight's shape): where one kernel's cost jumps at a few rows, another's can stay flat. A rule
fixed in code cannot be right everywhere, so `mtpkit.models.kernel_plan` times both kernels on
the model itself for every row count the decoder uses and gives every group a plan (row count
-> kernel); AR and every drafter then run on the same plan. Without a plan a group uses oneDNN for every row count.

Kernels (`KERNELS`): `stock` is each member's own layer, as torch computes it unpacked (no
fusion: on one row this can beat a fused product, whose outputs are strided views); `linear` is
`F.linear` on the (stacked) weight; `onednn` is oneDNN's `_linear_pointwise` on the weight packed
by `pack_rows`; `padded` is the same product over the rows padded with zero rows to `PACK_ROWS`
(fewer rows only): the kernel oneDNN packed the weight for, which on some CPUs multiplies 4 rows
faster than its own 1- or 2-row kernels multiply 1 or 2, and whose rows are those of the 4-row
product bit for bit. All run fp32 and bf16 (which is faster in bf16 depends on the CPU's bf16
support: `eval/bench_forward.py --dtype bfloat16` measures it). `pack_linears` leaves weights
below `MIN_PACK` elements alone (per-call overhead dominates both kernels there).

One mechanism, `PackedGroup`: the product of one or more members' weights stacked row-wise
(plus each gated LoRA member's A rows), packed again when a weight or bias changes in place,
split back into each member's columns. A `PackedLinear` or a `GatedLoRALinear` packed alone is
a group of one; `fuse_siblings` (on by default in `pack_linears`) merges the sibling
projections of one input (q/k/v, gate/up) into one group each.

Exactness: with the weight packed for a batch of 4 rows (`PACK_ROWS`), a row's oneDNN result
does not depend on how many rows are computed with it (tested; packed for 1 row it does), nor
a column's on which other columns are stacked with it, on the CPUs and widths checked up to
4096 inputs, except on an AMD EPYC at 1280 or 4096 inputs (any pack hint), where rows can
differ in the last bits with the row count. A plan that mixes kernels by row count computes an
AR step and a verification step with different kernels, which can differ in the last bits, as
torch's own 1-row and many-row kernels already do; greedy decoding stays token for token equal
to AR on the same target except at floating-point near-ties (the bench names those). A plan of
oneDNN only (`--linear onednn`) is row-invariant.

Inference only: with gradients enabled, or an input on another device, or an input dtype other
than the weights', every member runs its own unpacked forward (`F.linear` on the same weight).

On a GPU (`linear="auto"`): the same groups, computed with `F.linear` on the stacked weight for
every row count above one (`DEVICE_PLAN`; no oneDNN, no measured plan). A 135M-parameter model
decodes there bound by kernel launches, not by arithmetic, so one product for q/k/v with their
LoRA A rows, and one addmm for their gated rows, replace 9 products per attention (SmolLM2: 21 linear launches per gated layer
become 8, an AR step's 7 become 4). The members' weights become views of the stacked weight, so
the model's weights stay one copy. Ungated rows are W x of a wider product, which on a GPU can
differ from W x alone in the last bits (as a many-row product differs from a one-row one); greedy
decoding stays token for token equal to AR's except at floating-point near-ties, which the bench
names.

`cpu_paths(device)` is the one test of whether oneDNN, the kernel plan and the other CPU-only
decoding paths (MTPC's numpy bookkeeping, its int8 products, the lazy per-row LM head) apply.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

LINEARS = ("stock", "onednn", "auto")
KERNELS = ("stock", "linear", "onednn", "padded")  # what a plan chooses from, per row count
ONEDNN_KERNELS = ("onednn", "padded")  # the CPU-only ones
PACK_ROWS = 4  # oneDNN picks its kernel by this batch hint; 4 gives row-invariant results
MIN_PACK = 1 << 16  # elements: smaller weights stay nn.Linear
DTYPES = (torch.float32, torch.bfloat16)  # what the packed kernels run
DEVICE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what a GPU group runs (F.linear)
# a GPU group's plan: one row (an AR step) on each member's own layer, more rows fused. A 1-row
# step is bound by dispatch, which a fused group adds to (its per-call bookkeeping and strided
# outputs); a verification step of several rows saves more in products than it adds
DEVICE_PLAN = ("stock", "linear")

# projections that read the same input, in the order the layer calls them (Llama, Mistral, Qwen,
# SmolLM: attention's q/k/v, the MLP's gate/up)
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def cpu_paths(device: torch.device | str) -> bool:
    """Whether the CPU-only speed paths apply on `device`: oneDNN packing and the kernel plan
    (this module, `mtpkit.models.kernel_plan`), MTPC's numpy bookkeeping and int8 products
    (`mtpkit.models.mtpc.decode`) and the decoder's lazy per-row LM head. True only on the CPU;
    elsewhere packed groups compute with `F.linear` and tensors stay on the device (a host read
    of a GPU tensor waits for the GPU). The decoder's `Target.cpu_paths` holds it per target, so a test
    can run the device path on a CPU."""
    return torch.device(device).type == "cpu"


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def pack_rows(weight: torch.Tensor) -> torch.Tensor:
    """A [out, in] fp32 or bf16 weight in oneDNN's layout for `packed_forward`."""
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS)


def packed_forward(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] times a `pack_rows` weight (+ bias) -> [..., out]."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def padded_forward(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`packed_forward` of fewer than `PACK_ROWS` rows computed as `PACK_ROWS` rows (zero rows
    appended, their outputs dropped): oneDNN's kernel for the rows the weight was packed for."""
    rows = x.numel() // x.shape[-1]
    if rows >= PACK_ROWS:
        return packed_forward(x, packed, bias)
    flat = torch.cat([x.reshape(rows, x.shape[-1]), x.new_zeros(PACK_ROWS - rows, x.shape[-1])])
    y = packed_forward(flat, packed, bias)
    return y[:rows].view(*x.shape[:-1], y.shape[-1])  # the leading rows: contiguous


def _is_gated(module: nn.Module) -> bool:
    """A gated LoRA linear over a packed base (`GatedLoRALinear` after `pack_linears`)."""
    return isinstance(getattr(module, "base", None), PackedLinear) and hasattr(module, "At")


class PackedGroup:
    """Members that read the same input, computed as ONE product on their stacked weights.

    Members are `PackedLinear`s, or gated LoRA linears over packed bases that share one gate
    (`GatedLoRALinear`: y = W x, plus x A^T B^T on the gated rows). The stacked weight is

        [W_1; ...; W_m]                  plain members
        [W_1; ...; W_m; A_1; ...; A_m]   gated members: the A rows ride along in the product

    and gated rows then get one addmm with the block-diagonal [B_1, ..., B_m] (the LoRA scaling
    folded in): in place on a contiguous gated run of a batch-1 forward (decoding), else through
    `Gate.select`/`Gate.scatter`. On the CPU, members of one width and rank (gate/up) take one
    batched product over their own B_i on that run instead: the block-diagonal's zero blocks are
    half its bytes and products, which a step of several gated rows (quadratic decoding) pays.
    Ungated rows are W x exactly. Each member gets its own columns (a view); a group of one
    returns the product itself.

    Kernel: `plan[min(rows, len(plan)) - 1]` for a call over `rows` rows (`KERNELS`: `stock` =
    each member's own `unpacked` forward, torch's layer exactly; `linear` = `F.linear` on the
    stacked weight; `onednn` = oneDNN on the weight packed by `pack_rows`; `padded` = the same over rows padded to
    `PACK_ROWS`); no plan = oneDNN for
    every row count. `mtpkit.models.kernel_plan` measures and sets the plans. Off the CPU
    (`cpu_paths`) a group has no oneDNN: its plan is `DEVICE_PLAN`.
    A member's weight or bias changed in place is packed again at the next call. Not usable
    (gradients on, an input on another device, or an input dtype other than the weights'):
    each member runs its own `unpacked` forward.

    Why fuse: a decoding forward of a few rows on a CPU costs about the same per product whatever
    its width, so 7 products per layer cost more than 4 (and a gated LoRA's extra products more
    so). The first member called computes the product and keeps it for the others while they are called
    with the very same input tensor (same object and version)."""

    def __init__(self, members: list[nn.Module]):
        gated = _is_gated(members[0])
        bases = [m.base if gated else m for m in members]
        self.weights = [b.weight for b in bases]
        self.biases = [b.bias for b in bases]
        self.lora = [(m.At, m.Bt) for m in members] if gated else []  # ([in, r], [r, out]) per member
        self.gate = members[0].gate if gated else None
        self.tracked = [t for t in self.weights + self.biases if t is not None]
        self.device = self.weights[0].device
        self.onednn = cpu_paths(self.device)  # else a GPU group: no oneDNN, F.linear (DEVICE_PLAN)
        # what `usable` computes in (on the CPU bf16 only where oneDNN has it)
        self.dtypes = packable_dtypes() if self.onednn else DEVICE_DTYPES
        self.bounds, start = [], 0  # each member's columns of the output
        for b in bases:
            self.bounds.append((start, start + b.out_features))
            start += b.out_features
        self.out_features = start
        self.single = len(members) == 1
        self.plan = None if self.onednn else DEVICE_PLAN  # kernel per row count (index rows - 1); sets stock_numel
        self.version = None  # `_version`s of the tracked tensors when last packed
        self.input, self.input_version, self.output = None, -1, None
        for i, m in enumerate(members):
            m.group, m.index = self, i
            m.siblings = None if self.single else self

    def usable(self, x: torch.Tensor) -> bool:
        """Whether this group computes forward(x) (else each member runs `unpacked`)."""
        # x.is_cpu is `cpu_paths(x.device)`, inlined: this runs on every product of a forward
        return (not torch.is_grad_enabled() and (x.is_cpu if self.onednn else x.device == self.device)
                and x.dtype in self.dtypes and x.dtype is self.weights[0].dtype)

    @property
    def plan(self) -> tuple[str, ...] | None:
        return self._plan

    @plan.setter
    def plan(self, plan: tuple[str, ...] | None) -> None:
        if plan is not None and any(k not in KERNELS for k in plan):
            raise ValueError(f"a kernel plan holds only {KERNELS}, got {plan!r}")
        if not self.onednn and (plan is None or any(k in ONEDNN_KERNELS for k in plan)):
            raise ValueError(f"a group on {self.device} has no oneDNN kernel, got the plan {plan!r}")
        self._plan = None if plan is None else tuple(plan)
        rows = 0  # the leading row counts planned `stock`: a `PackedLinear` call over at most
        while plan is not None and rows < len(plan) and plan[rows] == "stock":  # these many input
            rows += 1  # elements is F.linear itself, with no dispatch at all (AR's 1-row step)
        if plan is not None and rows == len(plan):
            rows = float("inf")
        self.stock_numel = rows * self.weights[0].shape[1]

    def kernel(self, rows: int) -> str:
        """The kernel of a call over `rows` rows."""
        plan = self.plan
        return "onednn" if plan is None else plan[min(rows, len(plan)) - 1]

    def _pack(self) -> None:
        if len({w.dtype for w in self.weights}) > 1:
            raise ValueError(f"a packed group's members have different dtypes {sorted({str(w.dtype) for w in self.weights})}; "
                             "cast the whole model, not single layers")
        with torch.no_grad():
            rows = [w.detach() for w in self.weights] + [At.t() for At, _ in self.lora]
            self.weight = rows[0] if len(rows) == 1 else torch.cat(rows)  # [out (+ R), in]
            if all(b is None for b in self.biases):
                self.bias = None
            else:
                parts = [b.detach() if b is not None else w.new_zeros(w.shape[0])
                         for b, w in zip(self.biases, self.weights)]
                parts += [At.new_zeros(At.shape[1]) for At, _ in self.lora]
                self.bias = parts[0] if len(parts) == 1 else torch.cat(parts)
            self.B = torch.block_diag(*[Bt for _, Bt in self.lora]) if self.lora else None  # [R, out]
            # members of one width and rank (gate/up): their gated rows as one batched product over
            # their own B, without the block-diagonal's zero blocks (CPU groups: on a GPU a batched
            # product on strided views is not known to stay one launch)
            shapes = {Bt.shape for _, Bt in self.lora}
            self.batched = (torch.stack([Bt for _, Bt in self.lora])  # [m, r, out / m]
                            if self.onednn and len(self.lora) > 1 and len(shapes) == 1 else None)
            self.packed = pack_rows(self.weight) if self.onednn else None
            if not self.onednn and len(rows) > 1:
                # a GPU group keeps one copy of its members' weights (an 8B model's would not fit
                # twice): each member's weight becomes a view of its rows of the stacked one
                for w, (lo, hi) in zip(self.weights, self.bounds):
                    w.data = self.weight[lo:hi]
        self.version = [t._version for t in self.tracked]

    def _compute(self, x: torch.Tensor, kernel: str) -> torch.Tensor:
        if [t._version for t in self.tracked] != self.version:
            self._pack()
        if kernel == "linear":
            y = F.linear(x, self.weight, self.bias)
        elif kernel == "padded":
            y = padded_forward(x, self.packed, self.bias)
        else:
            y = packed_forward(x, self.packed, self.bias)
        gate = self.gate
        if gate is None:
            return y
        O = self.out_features
        if gate.rows is None or not gate.rows.numel():
            return y[..., :O]
        if gate.span is not None and x.dim() == 3 and x.shape[0] == 1 and y.is_contiguous():
            # the gated run's output and A columns as one `as_strided` view each (indexing would take
            # 4-6 view ops a group, each a dispatch: 120 groups a step on SmolLM2)
            s, e = gate.span
            n, W = e - s, y.shape[-1]
            at = y.storage_offset() + s * W  # the run's first row
            if self.batched is None:
                y.as_strided((n, O), (W, 1), at).addmm_(y.as_strided((n, W - O), (W, 1), at + O), self.B)
            else:  # [m, rows, out / m] += [m, rows, r] @ [m, r, out / m], views of y
                m = len(self.lora)
                w, r = O // m, (W - O) // m
                y.as_strided((m, n, w), (w, W, 1), at).baddbmm_(y.as_strided((m, n, r), (r, W, 1), at + O),
                                                               self.batched)
            return y[..., :O]  # a strided view: copying it out costs a visible share of a gated step
        return y[..., :O] + gate.scatter(gate.select(y[..., O:]) @ self.B, y[..., :O])

    def __call__(self, x: torch.Tensor, member: nn.Module) -> torch.Tensor:
        if torch.compiler.is_compiling():
            # a compiled step (`mtpkit.models.decoding.step`): torch's layers, whose products the
            # compiler plans itself; the group's weight-version checks and its siblings' shared
            # output are Python state that would break the step's graph
            return member.unpacked(x)
        kernel = self.kernel(x.numel() // x.shape[-1]) if self.usable(x) else "stock"
        if kernel == "stock":
            return member.unpacked(x)
        if self.single:
            return self._compute(x, kernel)
        if self.input is not x or self.input_version != x._version:
            self.output = self._compute(x, kernel)
            self.input, self.input_version = x, x._version
        lo, hi = self.bounds[member.index]
        return self.output[..., lo:hi]


class PackedLinear(nn.Module):
    """An `nn.Linear` computed by its `PackedGroup`: alone (a group of one) until `fuse_siblings`
    merges it with its siblings.

    Keeps the original `weight` Parameter (tied embeddings stay tied, state dicts unchanged)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        PackedGroup([self])  # sets self.group, self.index, self.siblings

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() <= self.group.stock_numel:  # planned `stock` (an AR step, say): the layer itself
            return F.linear(x, self.weight, self.bias)
        return self.group(x, self)

    def unpacked(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        kernel = "onednn" if self.group.onednn else "F.linear"
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, {kernel}"


def pack_linears(model: nn.Module, linear: str = "auto", min_numel: int | None = None, fuse: bool = True) -> int:
    """Swap every `nn.Linear` of `model` that `packable` names (in place) for a `PackedLinear`;
    returns how many. A gated LoRA linear whose base got packed becomes a group of one with its A
    rows. With `fuse`, the sibling projections of one input then become one group each
    (`fuse_siblings`); without, every group has one member.

    linear: `onednn` (CPU layers; error if this torch has no oneDNN), `auto` (CPU layers where
    oneDNN is available, and every GPU layer: `F.linear` groups), `stock` (nothing). Apply it
    after every adapter is attached (peft wraps nn.Linear only)."""
    if linear not in LINEARS:
        raise ValueError(f"linear must be one of {LINEARS}, got {linear!r}")
    if linear == "stock":
        return 0
    if linear == "onednn" and not onednn_available():
        raise ValueError("linear=onednn: this torch build has no oneDNN (torch.backends.mkldnn)")
    swaps = packable(model, min_numel, linear)
    for name, module in swaps:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, PackedLinear(module))
    for module in model.modules():
        if _is_gated(module) and module.group is None:
            PackedGroup([module])
    if fuse:
        fuse_siblings(model)
    return len(swaps)


@functools.cache
def packable_dtypes() -> tuple[torch.dtype, ...]:
    """The weight dtypes oneDNN packs on this CPU: fp32, and bf16 where the CPU has oneDNN's bf16
    kernels (AVX512-BF16, or AVX512 BW/VL/DQ, or AVX-NE-CONVERT); elsewhere a bf16 layer keeps
    torch's own forward."""
    bf16 = hasattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported") and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return DTYPES if bf16 else (torch.float32,)


def packable(model: nn.Module, min_numel: int | None = None, linear: str = "auto") -> list[tuple[str, nn.Linear]]:
    """The (name, layer) of every `nn.Linear` of `model` that `pack_linears(model, linear)` would
    swap, each of at least `min_numel` weights (default `MIN_PACK`): on the CPU, fp32 (or bf16,
    `packable_dtypes`) where this torch has oneDNN; off it (`linear="auto"` only), fp32, bf16 or
    fp16 on a GPU (not the meta device, which computes nothing)."""
    min_numel = MIN_PACK if min_numel is None else min_numel
    on_cpu = linear != "stock" and onednn_available()
    dtypes = packable_dtypes() if on_cpu else ()
    found = []
    for name, m in model.named_modules():
        if type(m) is not nn.Linear or m.weight.numel() < min_numel:
            continue
        device = m.weight.device
        if cpu_paths(device):
            if m.weight.dtype in dtypes:
                found.append((name, m))
        elif linear == "auto" and device.type != "meta" and m.weight.dtype in DEVICE_DTYPES:
            found.append((name, m))
    return found


def fuse_siblings(model: nn.Module, groups=SIBLINGS) -> int:
    """Merge every set of sibling projections of `model` (all packed linears, or all gated LoRA
    linears over packed bases sharing one gate, of one input width and device) into one
    `PackedGroup`; returns how many groups."""
    count = 0
    for parent in model.modules():
        for names in groups:
            members = [getattr(parent, n, None) for n in names]
            if any(m is None for m in members):
                continue
            plain = all(type(m) is PackedLinear for m in members)
            gated = all(_is_gated(m) for m in members) and len({id(m.gate) for m in members}) == 1
            if not (plain or gated):
                continue
            bases = [m if plain else m.base for m in members]
            if len({b.in_features for b in bases}) != 1 or len({b.weight.device for b in bases}) != 1:
                continue
            PackedGroup(members)
            count += 1
    return count
