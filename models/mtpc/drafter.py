"""The MTPC drafter: self-speculative decoding with a circuit head (arXiv:2511.11346, App. D).

Algorithm 2 (shared-state self-speculative decoding) on the shared decoder: every cycle is ONE
target forward over [root, drafted bytes]. With L LoRA draft layers the forward also returns
the shared state after layer N - L; the drafter feeds the states of newly accepted positions
through its own copy of the last L layers (its own KV cache, holding accepted positions only,
so it never rolls back) to get e_t. With L = 0, e_t is the verifier's own final state.

Cycles (`cycle=`):
- `alg2` (default), greedy: the paper's Algorithm 2. After an accepted draft the "free" bonus
  byte is dropped (its state would cost another forward) and the last accepted byte is the next
  root; when nothing is accepted the free byte is kept and the next cycle is a one-byte forward
  computing its state (an empty draft, "unset S state").
- `alg2`, speculative sampling: Algorithm 2 as printed is biased here. After a rejection at
  draft position s + 1 the bonus is a sample of the residual max(p - q, 0); dropping it and
  drawing position s + 1 afresh next cycle gives it probability min(p, q) + R p instead of p
  (R = the rejection mass). So the bonus is dropped only when every draft byte was accepted (it
  is then a plain sample of p); otherwise it is kept and the next window is drawn from the
  circuit of the newest byte that has a state, conditioned on the kept byte: q(x_2.. | x_1 =
  bonus), an exact proposal at no extra forward (tests/eval/test_mtpc_decoding.py shows the
  printed version failing the distribution test).
- `bonus`: standard speculative decoding: the bonus is always kept and every window is drawn
  conditioned on it (n - 1 draft bytes per cycle, no state-only cycles).

Drafts: greedy decoding proposes the circuit's max-product window (`circuits.mode`, as the MTPC
code's argmax query), or with `greedy=chain` the argmax of each conditional in turn (follows the
marginal, not one latent path: better for an undertrained mixture whose best single path is
not its typical output); speculative sampling (Algorithm 3) draws the window from the circuit and
hands the verifier its conditionals q(x_j | x_<j) = q(x_1..j) / q(x_1..j-1) lazily, only for
the positions it visits, in closed form (`circuits.next_log_probs_posterior`). Under sampling the
head's input units are computed lazily too (`LazyUnits`): all r units only for the positions
conditioned on or verified, one unit per other position; a BTree cycle (`LazyBTree`) also
projects only the sum weights its draws and conditionals read. Greedy drafts compute the whole
head (the mode and the chain read every unit).

`verify=path` verifies each byte with the input unit the draft's latent path selected (the
distribution it was drawn from given the path) instead of the prefix marginal. Speculative
sampling is exact for any proposal the drafter really drew from, and may condition on the
drafter's own randomness (the path), so the output is still distributed as the target's; the
verifier then needs no position's r units at all (for BTree: no full inner weights beyond the
kept byte's path either), at the price of the mixture's averaging (the marginal accepts more in
expectation, by concavity of min(p, q)).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from mtpkit.models.mtpc.circuits import (CircuitParams, greedy_chain, mode, next_log_probs_posterior, sample,
                                    sample_states, sample_tokens)
from mtpkit.models.drafter import Draft, Drafter, StepOutput
from mtpkit.models.mtpc.decode import LazyBTree, decode_window
from mtpkit.models.mtpc.head import load_head
from mtpkit.models.mtpc.model import MTPCModel

CYCLES = ("alg2", "bonus")
VERIFY = ("marginal", "path")
UNIT_DTYPES = {"float32": None, "bfloat16": torch.bfloat16, "int8": torch.int8}  # None: the head's own precision


@dataclass
class MTPCDraftConfig:
    head: str = ""
    """head folder (train/export.py output or a train/mtpc.py checkpoint-N/)"""
    n: int = 0
    """bytes of the window drafted per cycle; 0 = the head's n (fewer is exact: the marginal of the
    first n positions; verifying fewer bytes is cheaper)"""
    greedy: str = "mode"
    """greedy drafts: mode (max-product window, as the MTPC code) | chain (argmax of each conditional in turn)"""
    cycle: str = "alg2"
    """alg2 (the paper's Algorithm 2, made exact for sampling) | bonus (keep every bonus, condition on it)"""
    seed: int = 0
    """seed of the drafter's own sampling (speculative sampling only)"""
    units: str = "float32"
    """precision the sampling path reads the head's unembeddings (and BTree sum projections) in:
    float32 | bfloat16 (half the bytes of a memory-bound product) | int8 (weight-only, one scale
    per row: a quarter); all exact, the verifier uses the very q the draft came from"""
    verify: str = "marginal"
    """the q speculative sampling verifies each drafted byte with: marginal (q(x_i | x_<i), the
    circuit's prefix-marginal conditional: Algorithm 3) | path (the input unit the draft's latent
    path selected at i, the distribution the byte was drawn from given that path: exact as well,
    since the path is the drafter's own randomness, and cheaper, as no verified position needs
    all r units; but the mixture's averaging is lost, so fewer bytes are accepted, see
    docs/mtpc.md). Same for FF (one unit)"""
    trust_remote_code: bool = False
    """let a cirkit head's config name a `module:function` that loading imports and runs as its
    circuit builder (only for heads whose code you trust)"""


class LazyConditionals:
    """draft_probs for the verifier: row j is q(X_{offset+j} | window[:offset+j]) over V,
    computed on first use by `log_conditional(position)`."""

    def __init__(self, log_conditional, offset: int):
        self.log_conditional, self.offset, self.rows = log_conditional, offset, {}

    def __getitem__(self, j: int) -> torch.Tensor:
        if j not in self.rows:
            self.rows[j] = self.log_conditional(self.offset + j).exp()
        return self.rows[j]


class MTPCDrafter(Drafter):
    name = "mtpc"

    def __init__(self, config: MTPCDraftConfig = MTPCDraftConfig(), model: MTPCModel | None = None):
        if model is None and not config.head:
            raise ValueError("mtpc needs head=DIR (a folder written by train/export.py or a checkpoint-N/)")
        if config.greedy not in ("mode", "chain"):
            raise ValueError(f"mtpc greedy must be mode or chain, got {config.greedy!r}")
        if config.cycle not in CYCLES:
            raise ValueError(f"mtpc cycle must be one of {CYCLES}, got {config.cycle!r}")
        if config.units not in UNIT_DTYPES:
            raise ValueError(f"mtpc units must be one of {tuple(UNIT_DTYPES)}, got {config.units!r}")
        if config.verify not in VERIFY:
            raise ValueError(f"mtpc verify must be one of {VERIFY}, got {config.verify!r}")
        self.config, self.model = config, model
        # seeded once, not per prompt: every decode must draw fresh windows (a window repeated
        # across runs is not a sample from q, and the acceptance rule would be biased)
        self.gen = torch.Generator().manual_seed(config.seed)
        if model is not None:
            self._bind()

    def _bind(self) -> None:
        n = self.model.cfg.n
        if not 0 <= self.config.n <= n:
            raise ValueError(f"mtpc n={self.config.n}: the head's window is {n}")
        self.shared_layer = None if self.model.draft is None else self.model.draft.start
        self.model.eval()

    def adapt(self, model, shared: dict):
        if self.model is None:
            key = ("mtpc", self.config.head)
            if key not in shared:  # the head (and its draft layers) load on the CPU: moved to the target's device
                device = model.get_input_embeddings().weight.device
                shared[key] = load_head(self.config.head, model,
                                        trust_remote_code=self.config.trust_remote_code).to(device)
            self.model = shared[key]
        if self.model.backbone is not model:
            raise ValueError("mtpc: the head was loaded on another backbone object than the target")
        self._bind()
        return model, None

    def drop_bonus(self, accepted: int, proposed: int) -> bool:
        if self.config.cycle == "bonus":
            return False
        if self.sampling:  # exact: only a bonus drawn from p itself may be redrawn next cycle
            return accepted == proposed
        return accepted > 0 or proposed == 0

    def begin(self, target, prompt_ids: list[int]) -> None:
        self.n = self.config.n or self.model.cfg.n
        self.device = target.device
        self.cpu_paths = target.cpu_paths  # numpy bookkeeping (`LazyBTree`) only on a CPU
        if self.gen.device != self.device:  # the draws run where the head does, from a generator there
            self.gen = torch.Generator(self.device).manual_seed(self.config.seed)
        self.e = None          # e_t of the newest byte that has a state (None: unknown)
        self.given: list[int] = []  # kept bytes after it, without a state (the bonus)
        self.length = 0        # bytes in the sequence before the current step
        self.cache = DynamicCache() if self.model.draft is not None else None
        self.cached = 0        # positions the draft layers have processed

    def propose(self, tokens: list[int]) -> Draft:
        self.length = len(tokens)
        if self.e is None:
            return Draft.empty()
        m, n = len(self.given), self.n
        # positions of the circuit used: ff/cp/hmm cut to the marginal of the first n positions;
        # btree and cirkit circuits keep their window and the draft is its first n bytes (a
        # prefix of a window drawn from q is a draw from q's marginal: exact as well)
        span = n if self.model.cfg.arch in ("ff", "cp", "hmm") else self.model.cfg.n
        evidence = observed = None
        if m:
            evidence = torch.zeros(1, span, dtype=torch.long, device=self.device)
            evidence[0, :m] = torch.tensor(self.given, device=self.device)
            observed = torch.arange(span, device=self.device)[None] < m
        if self.sampling:  # input units (and btree sum weights) on demand: see LazyUnits, LazyBTree
            window, log_conditional = self._sample(evidence, observed, span)
            return Draft(tokens=window[m:n], parents=torch.arange(n - m),
                         draft_probs=LazyConditionals(log_conditional, m))
        params = self.model.head(self.e[None])
        if span < params.n and isinstance(params, CircuitParams):  # the marginal of the first n positions
            inner = None if params.inner is None else params.inner[:, : span - 1]
            params = CircuitParams(params.arch, params.log_phi[:, :span], params.root, inner)
        pick = mode if self.config.greedy == "mode" else greedy_chain
        window = pick(params, evidence, observed)[0, m:n]  # stays on the device: the verifier reads it
        return Draft(tokens=window, parents=torch.arange(len(window)))

    def _sample(self, evidence, observed, span: int):
        """A window [span] drawn from the circuit of e given the kept bytes, and the function
        giving its conditionals log q(X_i | window[:i])."""
        m, n, head = len(self.given), self.n, self.model.head
        dtype = UNIT_DTYPES[self.config.units]
        path = self.config.verify == "path"
        if self.model.cfg.arch == "btree" and self.cpu_paths:
            tree = LazyBTree(head, self.e, dtype)
            return tree.sample(self.gen, self.given, n), tree.drawn_conditional if path else tree.conditional
        params, units = decode_window(head, self.e, span, dtype)
        if units is None:  # a plugged-in cirkit circuit: conditional by conditional
            window = sample(params, self.gen, evidence, observed)[0]
        else:
            units.upto(m)
            states = sample_states(params, self.gen, evidence, observed)
            drawn = sample_tokens(units.selected(states, n), self.gen, None if m == 0 else evidence[:, :n],
                                  None if m == 0 else observed[:, :n])[0]
            window = torch.cat([drawn, drawn.new_zeros(span - n)])  # later positions: never read

        def log_conditional(i: int) -> torch.Tensor:
            if path and units is not None and units.drawn is not None:  # (FF sets none: its one unit is the marginal)
                first, _, rows = units.drawn
                return rows[i - first]
            if units is not None:  # the query reads the units of positions <= i
                units.upto(i + 1)
            return next_log_probs_posterior(params, window[None], i)[0]
        return window, log_conditional

    def observe(self, step: StepOutput) -> None:
        kept_bonus = bool(step.new_tokens) and len(step.new_tokens) > len(step.accepted)
        if kept_bonus and self.config.cycle == "alg2" and not self.sampling:
            self.e, self.given = None, []   # the paper's branch: a state-only cycle comes next
            return
        newest = step.last_node             # last accepted draft byte, or the root (0)
        self.given = [step.new_tokens[-1]] if kept_bonus else []
        if self.model.draft is None:
            self.e = step.hidden[newest]
            return
        # rows of the forward: context positions, then the (chain) draft; row i is position
        # first + i, so the accepted prefix is contiguous
        first = self.length - step.context_len   # absolute position of row 0
        upto = self.length - 1 + newest          # absolute position of the newest byte with a state
        if upto >= self.cached:
            rows = step.shared_hidden[self.cached - first: upto - first + 1][None]
            positions = torch.arange(self.cached, upto + 1, device=rows.device)[None]
            with torch.no_grad():
                e = self.model.draft(rows, positions, past_key_values=self.cache)
            self.cached = upto + 1
            self.e = e[0, -1]
