"""Any smooth, decomposable cirkit circuit as an MTPC head (`--arch cirkit --circuit NAME`).

The four MTPC structures have native code (models/mtpc/circuits.py). Any other circuit a user builds
with libcirkit can be a head too: `CirkitHead(symbolic, lm_head_weight)` takes a symbolic
circuit over the window's n variables whose input layers are categoricals over the byte
vocabulary V and whose inner layers are sums and products (Hadamard or Kronecker), and gives it
per-example parameters from the backbone's hidden state, as the native heads do:

- every folded categorical layer gets an unembedding per fold and unit, [F, K, V, d],
  initialised from the backbone's LM head, or from the matrix given for the fold's window
  position (`MTPCModel` passes `initial_unembeddings`: EvaByte's head i at position i), so at
  the start every input unit of a position is one distribution and the circuit is the FF head;
- every folded sum layer gets a projection per fold, weights softmax(P e + b) over each output
  unit's inputs, P drawn small.

The circuit is rebuilt with placeholder parameters and compiled once with the batched layer
rules of models/mtpc/circuit_cirkit.py; each query attaches the per-example tensors to the compiled
folds (parameters live per compiled fold, so no routing is needed). Queries go through cirkit:
the circuit itself (log-likelihood) and `IntegrateQuery` (marginals, all prefix marginals,
one position's conditional over V). Sampling and greedy drafts run position by position on
those conditionals, which is exact for any circuit (cirkit 0.3.1's `SamplingQuery` cannot
condition on evidence, which Algorithm 2's kept bonus byte needs). It is the general path, not
the fast one: n conditional queries per draft.

`circuit` names a builder: `random-binary-tree` (cirkit's RandomBinaryTree region graph, RAT-SPN
style, CP layers, 2 repetitions), `linear-tree` (cirkit's LinearTree region graph, CP layers),
or `package.module:function`, any importable function(n, r, V) returning a symbolic circuit.
"""

import importlib

import torch
from torch import Tensor, nn

from cirkit.backend.torch.queries import IntegrateQuery
from cirkit.symbolic.circuit import Circuit
from cirkit.symbolic.layers import CategoricalLayer, HadamardLayer, KroneckerLayer, SumLayer
from cirkit.symbolic.parameters import ConstantParameter, Parameter

from mtpkit.models.mtpc.circuit_cirkit import TorchBatchedCategoricalLayer, TorchBatchedSumLayer, pipeline_context


def _categorical(V: int):
    return lambda scope, num_units: CategoricalLayer(scope, num_units, num_categories=V)


def random_binary_tree(n: int, r: int, V: int) -> Circuit:
    """Random binary trees over the window positions (cirkit RandomBinaryTree, 2 repetitions)."""
    from cirkit.templates.region_graph.algorithms.random import RandomBinaryTree

    return RandomBinaryTree(n, num_repetitions=2, seed=42).build_circuit(
        input_factory=_categorical(V), sum_product="cp", num_input_units=r, num_sum_units=r)


def linear_tree(n: int, r: int, V: int) -> Circuit:
    """A left-to-right chain of splits over the window positions (cirkit LinearTree)."""
    from cirkit.templates.region_graph.algorithms.linear import LinearTree

    return LinearTree(n).build_circuit(input_factory=_categorical(V), sum_product="cp",
                                       num_input_units=r, num_sum_units=r)


BUILDERS = {"random-binary-tree": random_binary_tree, "linear-tree": linear_tree}


def build_circuit(name: str, n: int, r: int, V: int) -> Circuit:
    """The symbolic circuit a `--circuit` name stands for."""
    if name in BUILDERS:
        return BUILDERS[name](n, r, V)
    if ":" not in name:
        raise ValueError(f"--circuit {name!r}: use one of {sorted(BUILDERS)} or package.module:function")
    module, _, attr = name.partition(":")
    try:
        builder = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--circuit {name!r}: cannot import it ({e})") from e
    circuit = builder(n, r, V)
    if not isinstance(circuit, Circuit):
        raise ValueError(f"--circuit {name!r} returned {type(circuit).__name__}, not a cirkit symbolic Circuit")
    return circuit


def placeholder_copy(symbolic: Circuit, n: int, V: int) -> Circuit:
    """The same structure with constant placeholder parameters, checked to be an MTP head: smooth,
    decomposable, over variables 0..n-1, categorical inputs over V, sum and product layers."""
    if not symbolic.is_smooth or not symbolic.is_decomposable:
        raise ValueError("a cirkit head must be smooth and decomposable (so its marginals are one pass)")
    if len(symbolic.outputs) != 1 or symbolic.outputs[0].num_output_units != 1:
        raise ValueError("a cirkit head must have one output unit")
    mapping, variables = {}, set()
    for layer in symbolic.topological_ordering():
        if isinstance(layer, CategoricalLayer):
            if layer.num_categories != V:
                raise ValueError(f"a categorical input layer has {layer.num_categories} categories, the vocabulary {V}")
            if len(layer.scope) != 1:
                raise ValueError(f"input layers must each cover one position, got scope {set(layer.scope)}")
            variables |= set(layer.scope)
            K = layer.num_output_units
            new = CategoricalLayer(layer.scope, K, num_categories=V,
                                   logits=Parameter.from_input(ConstantParameter(K, V, value=0.0)))
        elif isinstance(layer, SumLayer):
            Ko, width = layer.num_output_units, layer.arity * layer.num_input_units
            new = SumLayer(layer.num_input_units, Ko, arity=layer.arity,
                           weight=Parameter.from_input(ConstantParameter(Ko, width, value=0.0)))
        elif isinstance(layer, (HadamardLayer, KroneckerLayer)):
            new = type(layer)(layer.num_input_units, arity=layer.arity)
        else:
            raise ValueError(f"unsupported cirkit layer {type(layer).__name__}: a head takes categorical "
                             "inputs, sum, Hadamard and Kronecker layers")
        mapping[layer] = new
    if variables != set(range(n)):
        raise ValueError(f"the circuit's variables are {sorted(variables)}, the window's 0..{n - 1}")
    inputs = {mapping[layer]: [mapping[i] for i in symbolic.layer_inputs(layer)] for layer in symbolic.layers}
    return Circuit(list(mapping.values()), inputs, [mapping[symbolic.outputs[0]]])


class CirkitHead(nn.Module):
    """hidden [B, d] -> `CirkitParams`: one compiled cirkit circuit, per-example parameters."""

    def __init__(self, symbolic: Circuit, n: int, lm_head_weight: Tensor, init_std: float = 0.02, seed: int = 0):
        """`lm_head_weight`: [V, d] (every input unit starts from it) or [n, V, d] (the units of
        window position i from row i)."""
        super().__init__()
        V, d = lm_head_weight.shape[-2:]
        self.n, self.vocab_size, self.hidden_size = n, V, d
        # a plain attribute, outside the module tree: its placeholder tensors are not weights
        self.__dict__["compiled"] = pipeline_context().compile(placeholder_copy(symbolic, n, V))
        self.__dict__["integrate"] = IntegrateQuery(self.compiled)
        self.categoricals = [m for m in self.compiled.layers if isinstance(m, TorchBatchedCategoricalLayer)]
        self.sums = [m for m in self.compiled.layers if isinstance(m, TorchBatchedSumLayer)]
        g = torch.Generator().manual_seed(seed)
        base = lm_head_weight.detach()
        base = base.expand(n, -1, -1) if base.dim() == 2 else base  # [n, V, d]
        if base.shape[0] != n:
            raise ValueError(f"CirkitHead: {base.shape[0]} initial unembeddings for a window of {n}")
        self.unembed = nn.ParameterList(  # fold f covers window position scope_idx[f]
            nn.Parameter(torch.empty(m.num_folds, m.num_output_units, V, d, dtype=torch.float32, device=base.device)
                         .copy_(base[m.scope_idx[:, 0].to(base.device)][:, None]))
            for m in self.categoricals)
        shapes = [(m.num_folds, m.num_output_units * m.arity * m.num_input_units) for m in self.sums]
        self.sum_proj = nn.ParameterList(nn.Parameter(torch.randn(F, k, d, generator=g) * init_std) for F, k in shapes)
        self.sum_bias = nn.ParameterList(nn.Parameter(torch.zeros(F, k)) for F, k in shapes)

    def forward(self, hidden: Tensor) -> "CirkitParams":
        h = hidden.to(self.unembed[0].dtype)
        cats = [torch.einsum("bd,fkvd->fbkv", h, u).log_softmax(-1) for u in self.unembed]  # [F, B, K, V]
        sums = []
        for m, p, b in zip(self.sums, self.sum_proj, self.sum_bias):
            logits = torch.einsum("bd,fkd->fbk", h, p) + b[:, None]
            sums.append(logits.view(m.num_folds, len(h), m.num_output_units, -1).log_softmax(-1))  # [F, B, Ko, H*Ki]
        return CirkitParams(self, cats, sums)

    @torch.no_grad()
    def decode(self, hidden: Tensor, n: int = 0, units_dtype: torch.dtype | None = None) -> tuple["CirkitParams", None]:
        """The circuit of one hidden state [d] (the drafter's entry point; no lazy units, so
        `units_dtype` is not used)."""
        if n and n != self.n:
            raise ValueError(f"a cirkit head drafts its whole window of {self.n}, not n={n}")
        return self(hidden[None]), None


class CirkitParams:
    """The per-example circuits of a batch, with the queries of models/mtpc/circuits.py as methods
    (the functions there hand every non-native circuit to these)."""

    arch = "cirkit"

    def __init__(self, head: CirkitHead, cats: list[Tensor], sums: list[Tensor]):
        self.head, self.cats, self.sums = head, cats, sums

    @property
    def n(self) -> int:
        return self.head.n

    @property
    def batch(self) -> int:
        return self.cats[0].shape[1]

    def index(self, rows: Tensor) -> "CirkitParams":
        return CirkitParams(self.head, [t[:, rows] for t in self.cats], [t[:, rows] for t in self.sums])

    def _attach(self) -> None:
        for layer, t in zip(self.head.categoricals, self.cats):
            layer.set_batched(t, None)
        for layer, t in zip(self.head.sums, self.sums):
            layer.batched_log_weight = t

    def log_prob(self, x: Tensor, observed: Tensor | None = None) -> Tensor:
        """log q(x_observed) [B] (unobserved positions integrated out by cirkit)."""
        self._attach()
        if observed is None:
            return self.head.compiled(x)[:, 0, 0]
        return self.head.integrate(x, integrate_vars=~observed)[:, 0, 0]

    def prefix_log_probs(self, x: Tensor, observed: Tensor | None = None) -> Tensor:
        """[B, n]: log q(x_1..x_{i+1}), one integration query per prefix length."""
        positions = torch.arange(self.n, device=x.device)
        out = []
        for i in range(self.n):
            keep = (positions <= i).expand_as(x)
            out.append(self.log_prob(x, keep if observed is None else keep & observed))
        return torch.stack(out, 1)

    def next_log_probs(self, prefix: Tensor, i: int) -> Tensor:
        """log q(X_i = v | x_<i) for every v [B, V]: per example one query over V rows that differ
        at position i, later positions integrated out (the example's parameters broadcast).
        Differentiable: the KL-to-target loss (train/mtpc.py --kl-weight) trains through it."""
        V, B = self.head.vocab_size, prefix.shape[0]
        observed = (torch.arange(self.n, device=prefix.device) <= i).expand(V, -1)
        out = []
        for b in range(B):
            x = prefix[b].repeat(V, 1)
            x[:, i] = torch.arange(V, device=prefix.device)
            joint = self.index(torch.tensor([b], device=prefix.device)).log_prob(x, observed)
            out.append(joint.log_softmax(-1))
        return torch.stack(out)

    @torch.no_grad()
    def chain(self, pick, evidence: Tensor | None = None, observed: Tensor | None = None) -> Tensor:
        """A window [B, n] chosen position by position by `pick(log q(X_i | chosen so far))`;
        observed positions keep their evidence."""
        B = self.batch
        device = self.cats[0].device
        window = torch.zeros(B, self.n, dtype=torch.long, device=device) if evidence is None else evidence.clone()
        for i in range(self.n):
            if observed is not None and bool(observed[:, i].all()):
                continue
            chosen = pick(self.next_log_probs(window, i))
            window[:, i] = chosen if observed is None else torch.where(observed[:, i], window[:, i], chosen)
        return window
