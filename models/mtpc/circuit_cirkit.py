"""The four MTPC circuits as cirkit (libcirkit 0.3.1) symbolic circuits with per-example parameters.

cirkit 0.3.1 compiles a circuit with one parameter set; an MTP head needs a different set per
example (per context position). As the MTPC authors did, the categorical and sum layers'
compilation rules are replaced, here by `TorchBatchedCategoricalLayer` / `TorchBatchedSumLayer`,
which use tensors attached per call. Every symbolic layer gets a constant placeholder
parameter whose value is an integer tag; after folding, entry [:, 0, 0] of each folded
placeholder names the tag of every fold, so the per-example tensors are routed to the right
fold without relying on cirkit's internal fold order (HMM inputs, for instance, fold in
reverse position order).

`CirkitCircuit(arch, n, r, V)` takes the same `CircuitParams` as the native code in
models/mtpc/circuits.py (same layouts, BTree inner nodes bottom-up) and answers `log_prob`,
`log_marginal` and `prefix_log_probs` through cirkit's compiled circuit and `IntegrateQuery`,
and `sample` through `SamplingQuery`. It exists to prove the native code right and to let any
other smooth, decomposable cirkit structure be used as a head; the native code is what
training and decoding run (see eval/bench_heads.py for the speed difference).

Pitfalls found on the way: the pipeline must not `optimize` (its fusion rules match the base
sum layer and would swap in layers holding the placeholder weights); compilation rules are
looked up by the annotation of their last argument, so this module must not use
`from __future__ import annotations`; `cirkit.pipeline.integrate` recompiles from the
symbolic circuit and would lose the attached parameters, so `IntegrateQuery` is used instead.
"""

from typing import Any

import torch
from torch import Tensor

from cirkit.backend.torch.layers.inner import TorchSumLayer
from cirkit.backend.torch.layers.input import TorchCategoricalLayer
from cirkit.backend.torch.queries import IntegrateQuery, SamplingQuery
from cirkit.pipeline import PipelineContext
from cirkit.symbolic.circuit import Circuit
from cirkit.symbolic.layers import CategoricalLayer, HadamardLayer, SumLayer
from cirkit.symbolic.parameters import ConstantParameter, Parameter
from cirkit.utils.scope import Scope

from mtpkit.models.mtpc.circuits import ARCHS, CircuitParams, num_inner


class TorchBatchedCategoricalLayer(TorchCategoricalLayer):
    """TorchCategoricalLayer that can use per-example logits.

    Per-example logits are attached with ``set_batched(src, pos)``:
        src : (B, M, K, V) tensor (e.g. the user's logphi, no copy is made)
        pos : (F,) long tensor, fold f uses src[:, pos[f]]      (pos=None: src is (F, B, K, V))
    If nothing is attached the layer behaves like the stock layer (placeholder parameter).
    ``normalized=True`` (default) declares that each categorical sums to one, so that
    integration returns log Z = 0 without a logsumexp over V (big speed-up for marginals).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._src: Tensor | None = None
        self._pos: Tensor | None = None
        self.normalized = True

    def set_batched(self, src: Tensor | None, pos: Tensor | None = None) -> None:
        self._src, self._pos = src, pos

    @property
    def batched_logits(self) -> Tensor | None:
        """Materialised (F, B, K, V) per-example logits (copies if pos is not None)."""
        if self._src is None or self._pos is None:
            return self._src
        return self._src.index_select(1, self._pos).transpose(0, 1)

    def log_unnormalized_likelihood(self, x: Tensor) -> Tensor:
        if self._src is None:
            return super().log_unnormalized_likelihood(x)
        x = x.long().squeeze(dim=2)  # (F, B, 1) -> (F, B)
        f, b = x.shape
        src = self._src
        if self._pos is None:  # src: (F, B', K, V)
            src = src.transpose(0, 1)
            pos = torch.arange(f, device=x.device)
        else:  # src: (B', M, K, V)
            pos = self._pos
        if src.shape[0] == b:
            bidx = torch.arange(b, device=x.device)
        elif src.shape[0] == 1:
            bidx = torch.zeros(b, dtype=torch.long, device=x.device)
        else:
            raise ValueError(f"param batch {src.shape[0]} incompatible with input batch {b}")
        # advanced indices separated by a slice -> result (F, B, K); no copy of src
        return src[bidx[None, :], pos[:, None], :, x]

    def log_partition_function(self) -> Tensor:
        if self._src is None:
            return super().log_partition_function()
        src = self._src
        if self.normalized:
            return torch.zeros(self.num_folds, 1, self.num_output_units,
                               dtype=src.dtype, device=src.device)
        return torch.logsumexp(self.batched_logits, dim=3)  # (F, B, K)

    def sample(self, num_samples: int = 1) -> Tensor:
        if self._src is None:
            return super().sample(num_samples)
        lp = self.batched_logits  # (F, B, K, V)
        s = torch.distributions.Categorical(logits=lp).sample((num_samples,))  # (N, F, B, K)
        return s.permute(1, 3, 0, 2).flatten(start_dim=2)  # (F, K, N*B), N-major


class TorchBatchedSumLayer(TorchSumLayer):
    """TorchSumLayer that can use per-example LOG weights of shape (F, B, Ko, H*Ki)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batched_log_weight: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        if self.batched_log_weight is None:
            return super().forward(x)
        # x: (F, H, B, Ki) -> (F, B, H*Ki)
        x = x.permute(0, 2, 1, 3).flatten(start_dim=2)
        lw = self.batched_log_weight
        if lw.shape[1] != x.shape[1]:
            lw = lw.expand(lw.shape[0], x.shape[1], *lw.shape[2:])
        # semiring-generic einsum: in 'lse-sum' it computes log(sum_i w_oi exp(x_i)) stably
        return self.semiring.einsum(
            "fbi,fboi->fbo", inputs=(x,), operands=(lw.exp(),), dim=-1, keepdim=True
        )  # (F, B, Ko)

    def sample(self, x: Tensor) -> tuple[Tensor, Tensor]:
        if self.batched_log_weight is None:
            return super().sample(x)
        lw = self.batched_log_weight  # (F, B, Ko, H*Ki)
        f, b, ko, _ = lw.shape
        x = x.flatten(1, 2)  # (F, H*Ki, N*B, D)
        n = x.shape[2] // b
        mix = torch.distributions.Categorical(logits=lw).sample((n,))  # (N, F, B, Ko)
        mix = mix.permute(1, 3, 0, 2).flatten(start_dim=2)  # (F, Ko, N*B)
        idx = mix.unsqueeze(-1).expand(f, ko, mix.shape[2], x.shape[3])
        return torch.gather(x, dim=1, index=idx), mix  # (F, Ko, N*B, D)


# Compilation rules: cirkit keys them on the annotation of the last argument (real classes).
def compile_batched_categorical_layer(compiler, sl: CategoricalLayer) -> TorchBatchedCategoricalLayer:
    return TorchBatchedCategoricalLayer(
        torch.tensor(tuple(sl.scope)), sl.num_output_units, num_categories=sl.num_categories,
        logits=compiler.compile_parameter(sl.logits), semiring=compiler.semiring)


def compile_batched_sum_layer(compiler, sl: SumLayer) -> TorchBatchedSumLayer:
    return TorchBatchedSumLayer(sl.num_input_units, sl.num_output_units, arity=sl.arity,
                                weight=compiler.compile_parameter(sl.weight), semiring=compiler.semiring)


def pipeline_context() -> PipelineContext:
    ctx = PipelineContext(backend="torch", semiring="lse-sum", fold=True, optimize=False)
    ctx.add_layer_compilation_rule(compile_batched_categorical_layer)
    ctx.add_layer_compilation_rule(compile_batched_sum_layer)
    return ctx


class _Tagger:
    """Creates layers whose placeholder parameters carry a tag naming their tensor slice."""

    def __init__(self, V: int):
        self.V = V
        self.bindings: list[tuple[str, int | None]] = []  # tag -> (tensor, index)

    def _placeholder(self, shape, binding) -> Parameter:
        self.bindings.append(binding)
        return Parameter.from_input(ConstantParameter(*shape, value=float(len(self.bindings) - 1)))

    def categorical(self, i: int, units: int) -> CategoricalLayer:
        return CategoricalLayer(Scope([i]), units, num_categories=self.V,
                                logits=self._placeholder((units, self.V), ("log_phi", i)))

    def sum(self, units_in: int, units_out: int, binding) -> SumLayer:
        return SumLayer(units_in, units_out, arity=1, weight=self._placeholder((units_out, units_in), binding))


def build_symbolic(arch: str, n: int, r: int, V: int) -> tuple[Circuit, list]:
    """The symbolic circuit of a structure and its tag -> (tensor, index) bindings."""
    if arch not in ARCHS:
        raise ValueError(f"unknown circuit arch {arch!r}; choose from {ARCHS}")
    num_inner(arch, n)  # validates n for btree
    tag = _Tagger(V)
    layers, inputs = [], {}

    def add(layer, ins=()):
        layers.append(layer)
        inputs[layer] = list(ins)
        return layer

    if arch == "ff":
        out = add(HadamardLayer(1, arity=n), [add(tag.categorical(i, 1)) for i in range(n)])
    elif arch == "cp":
        prod = add(HadamardLayer(r, arity=n), [add(tag.categorical(i, r)) for i in range(n)])
        out = add(tag.sum(r, 1, ("root", None)), [prod])
    elif arch == "hmm":  # nested from the last position: c_i = phi_i * (T_i c_{i+1})
        c = add(tag.categorical(n - 1, r))
        for i in range(n - 1, 0, -1):
            s = add(tag.sum(r, r, ("inner", i - 1)), [c])
            c = add(HadamardLayer(r, arity=2), [add(tag.categorical(i - 1, r)), s])
        out = add(tag.sum(r, 1, ("root", None)), [c])
    else:  # btree: inner node of span [lo, hi) at level log2(hi - lo) - 1, numbered bottom-up
        level_start, start, nodes = {}, 0, n // 2
        for level in range(n.bit_length()):
            level_start[level] = start
            start, nodes = start + nodes, nodes // 2

        def node(lo, hi):
            if hi - lo == 1:
                return add(tag.categorical(lo, r))
            mid = (lo + hi) // 2
            prod = add(HadamardLayer(r, arity=2), [node(lo, mid), node(mid, hi)])
            if hi - lo == n:
                return add(tag.sum(r, 1, ("root", None)), [prod])
            level = (hi - lo).bit_length() - 2
            return add(tag.sum(r, r, ("inner", level_start[level] + lo // (hi - lo))), [prod])

        out = node(0, n)
    return Circuit(layers, inputs, [out]), tag.bindings


class CirkitCircuit(torch.nn.Module):
    """A compiled cirkit circuit fed with `CircuitParams` (per example) before each query."""

    def __init__(self, arch: str, n: int, r: int, V: int):
        super().__init__()
        self.arch, self.n, self.r, self.V = arch, n, (1 if arch == "ff" else r), V
        self.symbolic, bindings = build_symbolic(arch, n, self.r, V)
        self.circuit = pipeline_context().compile(self.symbolic)
        self._targets = []  # (layer, kind, tensor name, index of every fold)
        for layer in self.circuit.layers:
            if isinstance(layer, TorchBatchedCategoricalLayer):
                kind, placeholder = "categorical", layer.logits()
            elif isinstance(layer, TorchBatchedSumLayer):
                kind, placeholder = "sum", layer.weight()
            else:
                continue
            tags = placeholder[:, 0, 0].round().long().tolist()
            names = {bindings[t][0] for t in tags}
            if len(names) != 1:
                raise RuntimeError(f"cirkit folded layers of different tensors together: {names}")
            self._targets.append((layer, kind, names.pop(), [bindings[t][1] for t in tags]))
        self._integrate = IntegrateQuery(self.circuit)

    def set_params(self, params: CircuitParams) -> None:
        if params.arch != self.arch or params.log_phi.shape[1:] != (self.n, self.r, self.V):
            raise ValueError(f"parameters of {params.arch} {tuple(params.log_phi.shape[1:])} do not fit "
                             f"this {self.arch} circuit {(self.n, self.r, self.V)}")
        # sum weights in log space, laid out as cirkit's (fold, batch, out units, in units)
        log_w = {"root": None if params.root is None else params.root.log()[:, None, :],
                 "inner": None if params.inner is None else params.inner.log()}
        for layer, kind, name, index in self._targets:
            if kind == "categorical":
                layer.set_batched(params.log_phi, torch.tensor(index, device=params.log_phi.device))
            elif index == [None]:
                layer.batched_log_weight = log_w[name].unsqueeze(0)
            else:
                layer.batched_log_weight = log_w[name][:, index].transpose(0, 1)

    def log_prob(self, params: CircuitParams, x: Tensor) -> Tensor:
        self.set_params(params)
        return self.circuit(x)[:, 0, 0]

    def log_marginal(self, params: CircuitParams, x: Tensor, observed: Tensor) -> Tensor:
        self.set_params(params)
        return self._integrate(x, integrate_vars=~observed)[:, 0, 0]

    def prefix_log_probs(self, params: CircuitParams, x: Tensor) -> Tensor:
        """[B, n]: log q(x_1..x_{i+1}), one IntegrateQuery per prefix length."""
        positions = torch.arange(self.n, device=x.device)
        return torch.stack([self.log_marginal(params, x, (positions <= i).expand_as(x))
                            for i in range(self.n)], 1)

    @torch.no_grad()
    def sample(self, params: CircuitParams, num_samples: int = 1) -> Tensor:
        """[num_samples, B, n] through cirkit's SamplingQuery (the batched layers draw per example)."""
        self.set_params(params)
        samples, _ = SamplingQuery(self.circuit)(num_samples=num_samples)
        return samples.reshape(num_samples, params.log_phi.shape[0], self.n).long()
