"""Decode-only kernels of the MTPC heads: what `MTPCDrafter` runs per cycle, never trained.

- `decode_window(head, e, n, units_dtype)`: the circuit of one hidden state with its input units
  computed on demand (`LazyUnits`): a cycle reads only the positions it drafts or verifies.
- `LazyBTree`: BTree sampling and conditionals with the r-vector bookkeeping in numpy (CPU only:
  `MTPCDrafter` takes the torch path of `decode_window` on a GPU, where numpy would copy every
  vector to the host).
- `Int8Rows`: weight-only int8 rows (one scale per row) for the memory-bound unit products
  (torch's int8 kernel on a CPU, a dequantizing product elsewhere);
  `weight_as(head, name, dtype)` keeps one decode copy of a weight per precision.
"""

from __future__ import annotations

import numpy as np
import torch

from mtpkit.models.mtpc.circuits import CircuitParams, _btree_levels
from mtpkit.models.mtpc.model import MTPCHead
from mtpkit.models.packed_linear import cpu_paths

class LazyUnits:
    """The input units of one decode-time circuit, computed per window position when needed.

    A full head forward is n * r * V * d multiply-adds: the whole unembedding, which at n = 16,
    r = 32 is 4.5x the parameters of the 11M byte backbone, and a memory-bound matrix-vector
    product on CPU. A speculative-sampling cycle needs far less: the r units of each position it
    conditions on or verifies (`upto`), and for every other position only the one unit its
    branch selected, to draw its byte (`selected`). `log_phi` [1, n, r, V] holds the computed
    positions; the circuit queries read it only there (`circuits.sample_states` at observed
    positions, `next_log_probs_posterior(.., i)` at positions <= i)."""

    def __init__(self, head: MTPCHead, h: torch.Tensor, n: int, dtype: torch.dtype | None = None):
        self.head, self.h, self.ready = head, h, 0
        # the products may read the unembeddings in a lower precision (bfloat16 halves the bytes
        # of this memory-bound product, int8 `Int8Rows` quarters them); the units stay in h's
        # precision, and a draw and the conditionals read the same values, so speculative
        # sampling stays exact
        self.weights = weight_as(head, "unembed", dtype or head.unembed.dtype)
        self.hw = h.to(self.weights.dtype)
        r, V = head.unembed.shape[1:3]
        self.log_phi = torch.zeros(1, n, r, V, dtype=h.dtype, device=h.device)
        self.drawn: tuple[int, list[int], torch.Tensor] | None = None  # (first position, units, log phi [k, V]) `selected` gave

    @torch.no_grad()
    def upto(self, i: int) -> None:
        """Compute every unit of positions < i."""
        i = min(i, self.log_phi.shape[1])
        if i > self.ready:
            logits = _matvec(self.weights[self.ready:i], self.hw).to(self.h.dtype)  # [k, r, V]
            self.log_phi[0, self.ready:i] = logits.log_softmax(-1)
            if self.drawn is not None:  # the very values a byte was drawn from (another product's
                first, units, rows = self.drawn  # rounding could differ in the last bits)
                for p in range(max(self.ready, first), min(i, first + len(units))):
                    self.log_phi[0, p, units[p - first]] = rows[p - first]
            self.ready = i

    @torch.no_grad()
    def selected(self, states: torch.Tensor, upto: int = 0) -> torch.Tensor:
        """log phi of the unit `states` [1, n] selects at each position: [1, n, V] (only the first
        `upto` positions if given)."""
        n, V = upto or self.log_phi.shape[1], self.log_phi.shape[-1]
        if self.log_phi.shape[2] == 1:  # FF: one unit per position, so all of them in one product
            self.upto(n)
            return self.log_phi[:, :n, 0]
        out = torch.empty(1, n, V, dtype=self.h.dtype, device=self.h.device)
        if self.ready:
            done = min(self.ready, n)
            out[0, :done] = self.log_phi[0, :done].gather(1, states[0, :done, None, None].expand(-1, 1, V)).squeeze(1)
        if self.ready < n:  # the selected unit of each position (`_blocks_matvec`)
            units = states[0, self.ready:n].tolist()
            rows = _blocks_matvec(self.weights, torch.arange(self.ready, n), states[0, self.ready:n], self.hw)
            out[0, self.ready:] = rows.to(self.h.dtype).log_softmax(-1)
            self.drawn = (self.ready, units, out[0, self.ready:])
        return out


class LazyBTree:
    """A BTree head's circuit for ONE hidden state, as a speculative-sampling cycle uses it: draw
    a window, then answer the verifier's conditionals q(X_i | x_<i) one position at a time,
    computing only what those read. The full head would project all n - 2 inner nodes' r x r
    weights (n r^2 d multiply-adds) and run an upward and a backward pass per conditional.

    - `sample` draws top-down like `circuits.sample`, and from the same generator draws the same
      window: each inner node reads only the row of its parent's choice (r x d of its
      projection), plus, where the evidence (the kept bonus byte) lies below it, the upward values
      of its children;
    - `conditional(i)` is `circuits.next_log_probs_posterior` in its BTree form, node by node:
      the outside value of each node on i's path comes from its parent's and its sibling's
      upward value (complete if the sibling lies before i, exactly 1 if after). Full node weights,
      upward and outside values are kept per node, so the conditionals of one cycle share them
      and position i + 1 mostly reuses position i's path.
    Input units: all r units (`leaves`) only up to the verified position, the selected one
    elsewhere. With `units_dtype` (bfloat16, int8) the unembeddings and inner projections are read
    in it; a unit or weight row a draw read is the row the conditionals use later (`drawn`), so
    draws and conditionals agree exactly.

    The products (unembeddings, projections) are torch's; everything after them works on vectors
    of r and runs in numpy, whose small ops cost less than a torch op's dispatch. That halves the
    aten calls of a cycle but saves little of its time on a CPU: after a backbone forward the
    weights a cycle reads (~16 MB at n = 16, r = 32, V = 260, d = 384 in int8) come from memory,
    and those reads are most of the cycle."""

    def __init__(self, head: MTPCHead, hidden: torch.Tensor, units_dtype: torch.dtype | None = None):
        if head.cfg.arch != "btree":
            raise ValueError(f"LazyBTree needs a btree head, got {head.cfg.arch!r}")
        self.head, self.r, n = head, head.cfg.units, head.cfg.n
        self.h = hidden.detach().to(head.unembed.dtype)
        self.unembed = weight_as(head, "unembed", units_dtype or head.unembed.dtype)  # [n, r, V, d]
        self.hw = self.h.to(self.unembed.dtype)
        self.levels = _btree_levels(n)  # inner levels, bottom-up: (first node, nodes)
        with torch.no_grad():
            self.log_root = (head.root @ self.h + head.root_bias).log_softmax(-1).numpy()  # [r]
        if self.levels:  # the inner projections, read in the units' precision too
            inner = weight_as(head, "inner", units_dtype or head.inner.dtype)
            self.inner = inner.view(len(inner), self.r, self.r, -1)  # [L, r (unit), r (input), d]
            self.inner_bias = head.inner_bias.detach().numpy().reshape(len(inner), self.r, self.r)
        self.leaves = np.empty((n, self.r, head.vocab_size), dtype=self.log_root.dtype)  # log phi, all units
        self.ready = 0  # positions < ready have all their units in `leaves`
        self.tokens: list[int] = []   # the window drawn last
        self.weights: dict[tuple[int, int], np.ndarray] = {}  # (level, k) -> W [r, r] (rows: the node's units)
        self.drawn: dict[int, tuple[list[int], np.ndarray]] = {}  # level -> (row of each node, their logits) a draw read
        self.drawn_units: dict[int, tuple[int, np.ndarray]] = {}  # position -> (unit, log phi [V]) a draw read
        self.up: dict[tuple, np.ndarray] = {}       # (level, k[, limit]) -> upward log value [r]
        self.outside: dict[tuple[int, int], np.ndarray] = {}  # (level, k) -> outside log value [r]

    @torch.no_grad()
    def _leaves_upto(self, i: int) -> None:
        """Every unit of positions < i, in one product."""
        i = min(i, len(self.leaves))
        if i > self.ready:
            logits = _matvec(self.unembed[self.ready:i], self.hw).to(self.h.dtype)  # [k, r, V]
            self.leaves[self.ready:i] = logits.log_softmax(-1).numpy()
            for p in range(self.ready, i):  # the very values a byte was drawn from (another
                if p in self.drawn_units:   # product's rounding could differ in the last bits)
                    unit, row = self.drawn_units[p]
                    self.leaves[p, unit] = row
            self.ready = i

    @torch.no_grad()
    def _weights(self, level: int, k: int) -> np.ndarray:
        """W [r, r] of node k of inner level `level` (probabilities; rows sum to 1)."""
        if (level, k) not in self.weights:
            node = self.levels[level][0] + k
            logits = _matvec(self.inner[node], self.hw).to(self.h.dtype).numpy() + self.inner_bias[node]  # [r, r]
            if level in self.drawn:  # the very row a draw used (another product may round differently)
                rows, values = self.drawn[level]
                logits[rows[k]] = values[k]
            self.weights[level, k] = _np_softmax(logits)
        return self.weights[level, k]

    def _upward(self, level: int, k: int, limit: int) -> np.ndarray | None:
        """log value [r] of node k of `level` (-1: the leaves) with the window's positions < limit
        observed and the rest summed out; None where nothing is observed (the value is 1)."""
        size = 2 ** (level + 1)
        if limit <= k * size:
            return None
        key = (level, k) if limit >= (k + 1) * size else (level, k, limit)
        if key not in self.up:
            if level == -1:
                self.up[key] = self.leaves[k, :, self.tokens[k]]
            else:
                left, right = self._upward(level - 1, 2 * k, limit), self._upward(level - 1, 2 * k + 1, limit)
                self.up[key] = _np_log_matvec(self._weights(level, k), left if right is None else left + right)
        return self.up[key]

    def _outside(self, level: int, k: int) -> np.ndarray:
        """log outside value [r] of node k of `level` given the positions before it (those after
        it summed out): the same for every position inside the node."""
        if (level, k) not in self.outside:
            if level == len(self.levels) - 1:
                g = self.log_root
            else:
                g = _np_log_matvec(self._weights(level + 1, k // 2).T, self._outside(level + 1, k // 2))
            sibling = self._upward(level, k ^ 1, k * 2 ** (level + 1))
            self.outside[level, k] = g if sibling is None else g + sibling
        return self.outside[level, k]

    def _message(self, level: int, k: int, m: int) -> np.ndarray | float:
        """The upward value of node k of `level`'s children given the first m positions."""
        left, right = self._upward(level - 1, 2 * k, m), self._upward(level - 1, 2 * k + 1, m)
        return 0.0 if left is None else left if right is None else left + right

    @torch.no_grad()
    def sample(self, generator: torch.Generator, given: list[int], n: int) -> torch.Tensor:
        """A window [n_head] from q(x | x_<m = given) (m = len(given)); only its first `n`
        positions are drawn, the rest stay 0 (a prefix of a window is a draw of the marginal).
        The uniforms come from `generator` in the shapes and order of `circuits.sample`."""
        m, dtype = len(given), self.h.dtype
        self.tokens = list(given)
        self.up.clear()
        self.outside.clear()
        self.drawn.clear()
        self.drawn_units.clear()
        self._leaves_upto(m)
        top = len(self.levels) - 1
        with np.errstate(divide="ignore"):
            choice = _np_draw(self.log_root + self._message(top + 1, 0, m), generator, dtype)
            rows = [choice, choice]  # the root's unit, for both halves
            for level in range(top, -1, -1):
                first, nodes = self.levels[level]
                ids = torch.arange(first, first + nodes)
                chosen = _rows(self.inner, ids, torch.tensor(rows))  # [nodes, r, d]: each node's row for its parent's unit
                logits = _matvec(chosen, self.hw).to(dtype).numpy() + self.inner_bias[ids.numpy(), rows]  # [nodes, r]
                evidence = range(-(-m // 2 ** (level + 1)))  # the nodes with evidence below them
                for k in evidence:  # projected in full already (by the root's message)
                    if (level, k) in self.weights:
                        logits[k] = np.log(self.weights[level, k][rows[k]])
                self.drawn[level] = (rows, logits)  # nodes projected later take their row from here
                log_rows = logits - _np_logsumexp(logits)[:, None]
                for k in evidence:
                    log_rows[k] += self._message(level, k, m)
                rows = [unit for unit in _np_draw(log_rows, generator, dtype).tolist() for _ in (0, 1)]
            # the tokens: the unit each position selected, one product over their rows
            units = rows[m:n]
            u = torch.rand(1, n, self.head.vocab_size, generator=generator, dtype=dtype)[0, m:].numpy()
            if units:
                logits = _blocks_matvec(self.unembed, torch.arange(m, n), torch.tensor(units), self.hw)  # [n - m, V]
                log_phi = logits.to(dtype).log_softmax(-1).numpy()
                for p, unit, row in zip(range(m, n), units, log_phi):
                    self.drawn_units[p] = (unit, row)
                drawn = _gumbel_argmax(log_phi, u).tolist()
            else:
                drawn = []
        self.tokens = list(given) + drawn
        window = torch.zeros(self.head.cfg.n, dtype=torch.long)
        window[:n] = torch.tensor(self.tokens, dtype=torch.long)
        return window

    def drawn_conditional(self, i: int) -> torch.Tensor:
        """log phi [V] of the unit the last draw's latent path selected at position i (>= the
        number of given bytes): the distribution byte i was drawn from given that path."""
        return torch.from_numpy(self.drawn_units[i][1])

    @torch.no_grad()
    def conditional(self, i: int) -> torch.Tensor:
        """log q(X_i | x_<i) [V] for the window drawn last."""
        self._leaves_upto(i + 1)
        with np.errstate(divide="ignore"):
            g = self._outside(-1, i)
            terms = (g - _np_logsumexp(g))[:, None] + self.leaves[i]  # [r, V]
            return torch.from_numpy(_np_logsumexp(terms.T))


def _np_logsumexp(x: np.ndarray) -> np.ndarray:
    """log sum exp over the last axis (max-shifted)."""
    top = x.max(-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0)
    return np.log(np.exp(x - top).sum(-1)) + top[..., 0]


def _np_softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _np_log_matvec(w: np.ndarray, log_v: np.ndarray) -> np.ndarray:
    """log(W @ exp(v)) for one vector: w [o, i] probabilities, log_v [i]. The decode-only twin of
    `circuits._logmatvec` (which keeps an exact gradient through zero weights for training): a
    max-shifted matrix-vector product, not a logsumexp over the broadcast [o, i]."""
    top = log_v.max()
    return np.log(w @ np.exp(log_v - top)) + top


def _np_draw(log_probs: np.ndarray, generator: torch.Generator, dtype: torch.dtype) -> np.ndarray:
    """`circuits._draw` (Gumbel-max) on numpy log-probabilities [..., k]: the uniforms come from
    `generator` in the same shape, so the draws match."""
    return _gumbel_argmax(log_probs, torch.rand((1,) + log_probs.shape, generator=generator, dtype=dtype)[0].numpy())


def _gumbel_argmax(log_probs: np.ndarray, u: np.ndarray) -> np.ndarray:
    """argmax(log p + Gumbel noise from the uniforms u), as `circuits._draw` computes it."""
    return (log_probs - np.log(-np.log(np.maximum(u, 1e-20)))).argmax(-1)


class Int8Rows:
    """A decode-time weight [..., K] in int8 with one scale per row (weight-only, symmetric):
    half the bytes of bfloat16 for the memory-bound head products (`units=int8`; torch's
    `_weight_int8pack_mm` kernel on CPU, a dequantizing product elsewhere). Products take
    bfloat16 inputs; indexing keeps rows and their scales together."""

    dtype = torch.bfloat16  # the precision of the inputs and outputs of its products

    def __init__(self, q: torch.Tensor, scales: torch.Tensor):
        self.q, self.scales = q, scales  # [..., K] int8, [...] bfloat16

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> "Int8Rows":
        weight = weight.detach().float()
        # the scales are kept in bfloat16 (the kernel's), so quantize with the rounded scales; 126
        # leaves room for rounding a scale down by up to 2^-9, so no row's largest weight clips
        scales = (weight.abs().amax(-1).clamp_min(1e-30) / 126).to(cls.dtype)
        q = (weight / scales.float()[..., None]).round().clamp(-127, 127).to(torch.int8)
        return cls(q, scales)

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scales.float()[..., None]

    def __getitem__(self, index) -> "Int8Rows":
        return Int8Rows(self.q[index], self.scales[index])

    def __len__(self) -> int:
        return len(self.q)

    def view(self, *shape: int) -> "Int8Rows":
        q = self.q.view(*shape)
        return Int8Rows(q, self.scales.view(q.shape[:-1]))

    def matvec(self, x: torch.Tensor) -> torch.Tensor:
        """W @ x [...] for x [K] (bfloat16)."""
        q = self.q.reshape(-1, self.q.shape[-1])
        # the kernel reads its input in whole vector blocks: on a row length that is not a multiple
        # of the block it reads past the end (garbage, or a segfault, seen at K = 8 and 24)
        if _INT8_MM is not None and q.device.type == "cpu" and q.shape[-1] % _INT8_MM_BLOCK == 0:
            out = _INT8_MM(x[None], q, self.scales.reshape(-1))[0]
        else:
            out = (q.to(x.dtype) @ x) * self.scales.reshape(-1)
        return out.view(self.q.shape[:-1])


_INT8_MM = getattr(torch, "_weight_int8pack_mm", None)  # torch's weight-only int8 kernel (CPU)
_INT8_MM_BLOCK = 32  # row lengths the kernel handles (multiples of 16 were exact on AVX-512; 32 for margin)


def _blocks_matvec(w: "torch.Tensor | Int8Rows", i: torch.Tensor, j: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """w[i, j] @ x for w [I, J, N, K], index vectors i, j [k] -> [k, N]. int8, or off the CPU
    (`cpu_paths`: the indices stay on the device, unread): one product over the blocks copied by
    `_rows`; floating point on a CPU: one product per block on a view (a copy of the blocks
    costs as much as the product there)."""
    device = (w.q if isinstance(w, Int8Rows) else w).device
    if isinstance(w, Int8Rows) or not cpu_paths(device):
        return _matvec(_rows(w, i.to(device), j.to(device)), x)
    return torch.stack([_matvec(w[a, b], x) for a, b in zip(i.tolist(), j.tolist())])


def _rows(w: "torch.Tensor | Int8Rows", i: torch.Tensor, j: torch.Tensor) -> "torch.Tensor | Int8Rows":
    """w[i, j] for w [I, J, ...] and index vectors i, j [k]: rows copied with `index_select`
    on a flattened view (much faster than advanced indexing on CPU)."""
    if isinstance(w, Int8Rows):
        return Int8Rows(_rows(w.q, i, j), _rows(w.scales, i, j))
    J = w.shape[1]
    return w.reshape(len(w) * J, -1).index_select(0, i * J + j).view(len(i), *w.shape[2:])


def _matvec(w: "torch.Tensor | Int8Rows", x: torch.Tensor) -> torch.Tensor:
    """w [..., K] @ x [K] -> [...]: one matrix-vector product over all leading dimensions."""
    if isinstance(w, Int8Rows):
        return w.matvec(x)
    return (w.reshape(-1, w.shape[-1]) @ x).view(w.shape[:-1])


@torch.no_grad()
def decode_window(head, hidden: torch.Tensor, n: int = 0, units_dtype: torch.dtype | None = None
                  ) -> tuple[CircuitParams, "LazyUnits"]:
    """The circuit of ONE hidden state [d] of `head` (an `MTPCHead`) over the first `n` window
    positions (0 = all; a marginal of the window for ff/cp/hmm), with its input units left to
    compute on demand: `params.log_phi` is the buffer `units` fills (see `LazyUnits`). With
    `units_dtype` the inner sum weights are projected in that precision as well. A cirkit
    head (`mtpkit.models.mtpc.cirkit_head.CirkitHead`) answers with its own `decode` (units None)."""
    if not isinstance(head, MTPCHead):
        return head.decode(hidden, n, units_dtype)
    n = n or head.cfg.n
    if n < head.cfg.n and head.cfg.arch == "btree":
        raise ValueError("a btree window cannot be cut: its tree spans the whole window")
    h = hidden.to(head.unembed.dtype)
    units = LazyUnits(head, h, n, units_dtype)
    inner_logits = None  # the inner projections in the units' precision too
    if head.inner is not None and units_dtype not in (None, head.inner.dtype):
        inner_logits = _matvec(weight_as(head, "inner", units_dtype), units.hw).to(h.dtype)[None]  # [1, L, r * r]
    root, inner = head._sums(h[None], inner_logits)
    if inner is not None and head.cfg.arch == "hmm":
        inner = inner[:, : n - 1]
    return CircuitParams(head.cfg.arch, units.log_phi, root, inner), units


@torch.no_grad()
def weight_as(head: MTPCHead, name: str, dtype: torch.dtype) -> "torch.Tensor | Int8Rows":
    """Parameter `name` ("unembed", "inner") of `head` in `dtype` for decoding (torch.int8:
    `Int8Rows`), converted once (again after a weight update)."""
    weight = getattr(head, name)
    if dtype == weight.dtype:
        return weight
    # one copy per precision: drafters of several precisions may share this head (a bench)
    copies = head.__dict__.setdefault("_decode_copies", {})
    if copies.get((name, dtype), (None,))[0] != weight._version:
        copy = Int8Rows.quantize(weight) if dtype == torch.int8 else weight.detach().to(dtype)
        copies[name, dtype] = (weight._version, copy)
    return copies[name, dtype][1]
