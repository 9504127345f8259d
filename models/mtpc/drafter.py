"""The MTPC drafter: self-speculative decoding with a circuit head (arXiv:2511.11346, App. D).

Algorithm 2 (shared-state self-speculative decoding) on the shared decoder: every cycle is ONE
target forward over [root, drafted bytes]. With L LoRA draft layers the forward also returns
the shared state after layer N - L; the drafter feeds the states of newly accepted positions
through its own copy of the last L layers (its own KV cache, holding accepted positions only,
so it never rolls back) to get e_t. With L = 0, e_t is the verifier's own final state.

The cycle:
- greedy: the paper's Algorithm 2. After an accepted draft the "free" bonus byte is dropped (its
  state would cost another forward) and the last accepted byte is the next root; when nothing is
  accepted the free byte is kept and the next cycle is a one-byte forward computing its state (an
  empty draft, "unset S state").
- speculative sampling: Algorithm 2 as printed is biased here. After a rejection at
  draft position s + 1 the bonus is a sample of the residual max(p - q, 0); dropping it and
  drawing position s + 1 afresh next cycle gives it probability min(p, q) + R p instead of p
  (R = the rejection mass). So the bonus is dropped only when every draft byte was accepted (it
  is then a plain sample of p); otherwise it is kept and the next window is drawn from the
  circuit of the newest byte that has a state, conditioned on the kept byte: q(x_2.. | x_1 =
  bonus), an exact proposal at no extra forward (tests/eval/test_mtpc_decoding.py shows the
  printed version failing the distribution test).

Drafts: greedy decoding proposes the circuit's max-product window (`circuits.mode`, as the MTPC
code's argmax query; `tree=chainN` drafts the argmax of each conditional in turn instead, which
follows the marginal, not one latent path); speculative sampling (Algorithm 3) draws the window from the circuit and
hands the verifier its conditionals q(x_j | x_<j) = q(x_1..j) / q(x_1..j-1) lazily, only for
the positions it visits, in closed form (`circuits.next_log_probs_posterior`). Under sampling the
head's input units are computed lazily too (`LazyUnits`): all r units only for the positions
conditioned on or verified, one unit per other position; a BTree cycle (`LazyBTree`) also
projects only the sum weights its draws and conditionals read. Greedy chain drafts compute the whole
head (the mode reads every unit, in `units`' precision); greedy trees, only the units of the positions
their depth reaches (as sampled trees).

On a backbone with windowed attention (EvaByte's EVA) a draft stops at the window's end
(`adapter.draft_room`: the step's nodes must share the root's window); a root at the window's
last position drafts nothing and keeps its bonus.

`verify=path` verifies each byte with the input unit the draft's latent path selected (the
distribution it was drawn from given the path) instead of the prefix marginal. Speculative
sampling is exact for any proposal the drafter really drew from, and may condition on the
drafter's own randomness (the path), so the output is still distributed as the target's; the
verifier then needs no position's r units at all (for BTree: no full inner weights beyond the
kept byte's path either), at the price of the mixture's averaging (the marginal accepts more in
expectation, by concavity of min(p, q)).

Trees (`tree=`, rank paths; how each node's byte is drafted and why sampling them without
replacement is exact: `mtpkit.models.mtpc.draft_trees`). Under sampling the bonus is dropped only
when the whole depth was accepted: the last accepted node is then a leaf, whose bonus is a plain
sample of p. `verify=path` and the max-product window do not apply to trees. With a tree schedule
(`tree=bank.json,schedule=ladder|hyst,task=T`) the tree of each draft is chosen by the path value
(`draft_trees.chain_value`; one host read per step; static schedules compute none). Every
scheduled tree's levels are built once per device, so a switch is a lookup.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from mtpkit.models.decoding.drafter import Draft, Drafter, StepOutput
from mtpkit.models.head_folder import recorded_backbone
from mtpkit.models.mtpc.circuits import (CircuitParams, mode, next_log_probs_posterior, sample, sample_states,
                                         sample_tokens)
from mtpkit.models.mtpc.decode import LazyBTree, decode_window
from mtpkit.models.mtpc.draft_trees import chain_value, draft_tree, load_trees, tree_levels
from mtpkit.models.mtpc.head import load_head, read_settings
from mtpkit.models.mtpc.model import MTPCHead, MTPCModel
from mtpkit.models.schedules import path_signal
from mtpkit.models.trees import TreeOptions, check_ranks

VERIFY = ("marginal", "path")
UNIT_DTYPES = {"float32": None, "bfloat16": torch.bfloat16, "int8": torch.int8}  # None: the head's own precision


@dataclass
class MTPCDraftConfig(TreeOptions):
    head: str = ""
    """head folder (train/export.py output or a train/mtpc.py checkpoint-N/)"""
    n: int = 0
    """bytes of the window drafted per cycle; 0 = the head's n (fewer is exact: the marginal of the
    first n positions). Fewer where long drafts are mostly rejected: verifying fewer bytes is cheaper"""
    seed: int = 0
    """seed of the drafter's own sampling (speculative sampling only): another seed, another draw"""
    units: str = "float32"
    """precision the sampling path and greedy trees read the head's unembeddings (and BTree sum projections) in:
    float32 | bfloat16 (half the bytes of a memory-bound product) | int8 (weight-only, one scale
    per row: a quarter); all exact, the verifier uses the very q the draft came from. int8 where
    those reads bound the step (a CPU)"""
    verify: str = "marginal"
    """the q speculative sampling verifies each drafted byte with: marginal (q(x_i | x_<i), the
    circuit's prefix-marginal conditional: Algorithm 3) | path (the input unit the draft's latent
    path selected at i, the distribution the byte was drawn from given that path: exact as well,
    since the path is the drafter's own randomness, and cheaper, as no verified position needs
    all r units; but the mixture's averaging is lost, so fewer bytes are accepted, see
    docs/mtpc.md). Same for FF (one unit). path where a cycle's cost, not its acceptance, limits
    the speed-up"""
    tree: str = ""
    """draft a TREE of rank paths instead of a chain: chainN, a JSON list of rank paths such as
    [[0],[1],[0,0]], or a .json file holding one such list or a bank written by
    eval/tree_frontier.py --method mtpc (its tree `index`, or its trees switched by `schedule`).
    Node (r_1..r_d) is the r_d-th most probable byte of the circuit's exact conditional given its
    parent's path (greedy), or the r_d-th draw without replacement from it (sampling: exact, see
    mtpkit.models.mtpc.draft_trees). At most n deep; '' = chain. A tree where a wider draft pays (see
    eval/tree_frontier.py --method mtpc)"""
    trust_remote_code: bool = False
    """let a cirkit head's config name a `module:function` that loading imports and runs as its
    circuit builder (only for heads whose code you trust)"""
    allow_other_backbone: bool = False
    """run a head on a backbone other than the one it was trained on (refused otherwise; the bench
    marks the row), e.g. to see how a head transfers to a fine-tune of its backbone"""


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
        if config.units not in UNIT_DTYPES:
            raise ValueError(f"mtpc units must be one of {tuple(UNIT_DTYPES)}, got {config.units!r}")
        if config.verify not in VERIFY:
            raise ValueError(f"mtpc verify must be one of {VERIFY}, got {config.verify!r}")
        self.trees, self.schedule = load_trees(config) if config.tree else (None, None)
        self.tree = None if self.trees is None else self.trees[self.schedule.trees[0]]  # the tree in use
        self.deepest = 0 if self.trees is None else max(self.trees[i].depth for i in self.schedule.trees)
        self.tree_log = open(config.log, "a", buffering=1) if config.tree and config.log else None
        if self.tree is not None and config.verify == "path":
            raise ValueError(f"mtpc tree={config.tree!r}: verify=path applies to chain drafts only (a tree's "
                             "bytes are drawn from the prefix conditionals and verified with them)")
        if config.n < 0:
            raise ValueError(f"mtpc n={config.n}: a window of n >= 0 bytes (0 = the head's n)")
        self.levels_device = None  # the device `levels` (`tree_levels`) were built on
        self.config, self.model = config, model
        if model is None:  # the head's settings checked now, before any model loads
            head_config, settings = read_settings(config.head)
            self._check_fits(settings.n, recorded_backbone(head_config).get("vocab_size"))
        # seeded once, not per prompt: every decode must draw fresh windows (a window repeated
        # across runs is not a sample from q, and the acceptance rule would be biased)
        self.gen = torch.Generator().manual_seed(config.seed)
        if model is not None:
            self._bind()

    def _check_fits(self, n: int, vocab_size: int | None) -> None:
        """The options against a head of window `n` over `vocab_size` bytes (None: unknown)."""
        if not 0 <= self.config.n <= n:
            raise ValueError(f"mtpc n={self.config.n}: the head's window is {n}")
        if self.tree is not None:
            window = self.config.n or n
            if self.deepest > window:
                raise ValueError(f"mtpc tree={self.config.tree!r}: depth {self.deepest} does not fit the window "
                                 f"(n={window}: at most {window} deep)")
            if isinstance(vocab_size, int):
                check_ranks(self.trees, vocab_size, f"mtpc tree={self.config.tree!r}")

    def _bind(self) -> None:
        self._check_fits(self.model.cfg.n, self.model.adapter.vocab_size)
        self.shared_layer = None if self.model.draft is None else self.model.draft.start
        self.model.eval()

    def adapt(self, model, shared: dict):
        if self.model is None:
            key = ("mtpc", self.config.head)
            if key not in shared:  # the head (and its draft layers) load on the CPU: moved to the target's device
                device = model.get_input_embeddings().weight.device
                shared[key] = load_head(self.config.head, model, trust_remote_code=self.config.trust_remote_code,
                                        allow_other_backbone=self.config.allow_other_backbone).to(device)
            self.model = shared[key]
        if self.model.backbone is not model:
            raise ValueError("mtpc: the head was loaded on another backbone object than the target")
        self._bind()
        return model, None

    def drop_bonus(self, accepted: int, proposed: int) -> bool:
        if self.window_end:  # nothing drafted for want of room, not of a state: keep the bonus
            return False
        if self.sampling:  # exact: only a bonus drawn from p itself may be redrawn next cycle, i.e.
            return accepted == self.draft_depth  # one after a leaf (a chain: every byte accepted)
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
        draft = self.model.draft
        # the draft layers' own cache (accepted positions only; EvaByte: an EVA cache)
        self.cache = None if draft is None else self.model.adapter.layer_cache(len(draft.layers))
        self.room = self.model.adapter.draft_room  # draft nodes allowed after a root (EvaByte: up to its window's end)
        self.window_end = False  # the step in flight is a root with no room to draft: its bonus stays
        self.cached = 0        # positions the draft layers have processed
        self.last = None       # (tokens, their length, e, given) of the last draft with a state (`redo_draft`)
        self.draft_depth = 0   # depth of the draft in flight
        if self.tree is not None:
            if self.levels_device != self.device:  # each scheduled tree's levels, built once: a switch is a lookup
                self.levels_of = {i: tree_levels(self.trees[i], self.device) for i in self.schedule.trees}
                self.levels_device = self.device
            self.position = self.schedule.start()  # index into schedule.trees
            self.tree = self.trees[self.schedule.trees[self.position]]
            self.levels = self.levels_of[self.schedule.trees[self.position]]
            self.target_top1 = None  # the target's top-1 probability at the newest byte with a state
            self.value = None        # the path value that chose the tree in flight

    def propose(self, tokens: list[int]) -> Draft:
        self.length, self.draft_depth, self.window_end = len(tokens), 0, False
        if self.e is None:  # (a state-only cycle: its bonus is dropped, the root fed again with a draft)
            return Draft.empty()
        m, n = len(self.given), self.n
        room = self.room(len(tokens) - 1)  # the root is the newest token
        if room is not None and room < n - m:  # the backbone's attention window ends first
            if room == 0:  # the root ends the window: nothing may follow it, its bonus stays
                self.window_end = True
                return Draft.empty()
            n = m + room
        self.draft_depth = n - m
        self.last = (tokens, len(tokens), self.e, self.given)
        # positions of the circuit used: ff/cp/hmm cut to the marginal of the first n positions;
        # btree and cirkit circuits keep their window and the draft is its first n bytes (a
        # prefix of a window drawn from q is a draw from q's marginal: exact as well)
        span = n if self.model.cfg.arch in ("ff", "cp", "hmm") else self.model.cfg.n
        if self.tree is not None:
            return self._propose_tree(span, n)
        evidence = observed = None
        if m:
            evidence = torch.zeros(1, span, dtype=torch.long, device=self.device)
            evidence[0, :m] = torch.tensor(self.given, device=self.device)
            observed = torch.arange(span, device=self.device)[None] < m
        if self.sampling:  # input units (and btree sum weights) on demand: see LazyUnits, LazyBTree
            window, log_conditional = self._sample(evidence, observed, span, n)
            return Draft(tokens=window[m:n], parents=list(range(n - m)),
                         draft_probs=LazyConditionals(log_conditional, m))
        window = mode(self._head_params(span), evidence, observed)[0, m:n]  # stays on the device: the verifier reads it
        return Draft(tokens=window, parents=list(range(len(window))))

    def redo_draft(self) -> None:
        """The last draft with a state proposed again and dropped: every attribute and the draws'
        generator as they were."""
        if self.last is None:
            return
        tokens, length, e, given = self.last
        saved, draws = dict(self.__dict__), self.gen.get_state()
        self.e, self.given = e, given
        try:
            with torch.no_grad():
                self.propose(tokens[:length])
        finally:
            self.__dict__.clear()
            self.__dict__.update(saved)
            self.gen.set_state(draws)

    def _head_params(self, span: int):
        """The whole head's circuit of e over its first `span` positions (greedy drafts), its input
        units read in `units`' precision (int8 reads a quarter of the float32 bytes)."""
        if isinstance(self.model.head, MTPCHead):
            params, units = decode_window(self.model.head, self.e, span, UNIT_DTYPES[self.config.units])
            units.upto(span)  # the mode reads every unit of every position
            return params
        params = self.model.head(self.e[None])
        if span < params.n and isinstance(params, CircuitParams):  # the marginal of the first n positions
            inner = None if params.inner is None else params.inner[:, : span - 1]
            params = CircuitParams(params.arch, params.log_phi[:, :span], params.root, inner)
        return params

    def _propose_tree(self, span: int, n: int) -> Draft:
        """The draft tree cut to the window the kept bytes leave (`draft_tree`), `n` bytes of it at
        most; with a ladder or hyst schedule, the tree is first chosen by the path value (`chain_value`)."""
        m, deepest = len(self.given), self.deepest
        if self.sampling or isinstance(self.model.head, MTPCHead):
            # the conditionals read the units of positions < m + depth only: computed lazily
            params, units = decode_window(self.model.head, self.e, span, UNIT_DTYPES[self.config.units])
            if units is not None:
                units.upto(m + min(deepest, self.n - m))
        else:
            params = self._head_params(span)
        root = None
        if self.schedule.switches and self.target_top1 is not None:
            depth = min(self.schedule.depth_of_value(deepest), self.n - m)
            head, root = chain_value(params, span, self.given, depth, self.device)
            self.value = path_signal(self.schedule.signal, self.target_top1, head)
            self.position = self.schedule.next(self.position, self.value)
            index = self.schedule.trees[self.position]
            self.tree, self.levels = self.trees[index], self.levels_of[index]
        depth = min(self.tree.depth, n - m)
        self.draft_depth = depth
        tokens, probs = draft_tree(params, span, self.given, self.tree, self.levels[:depth], self.device,
                                   self.gen if self.sampling else None, root)
        return Draft(tokens=tokens, parents=list(self.tree.parents[:len(tokens)]), draft_probs=probs)

    def _observe_tree(self, step: StepOutput) -> None:
        """The step's line in the tree log; for a ladder or hyst schedule, the target's top-1
        probability at the last accepted node (the path value's first factor, one host read)."""
        if self.tree_log is not None:
            used = self.schedule.trees[self.position] if self.draft_depth else None
            self.tree_log.write(json.dumps({"tree": used, "accepted": len(step.accepted),
                                            "value": self.value if used is not None else None}) + "\n")
        if self.schedule.switches:
            self.target_top1 = float(torch.softmax(step.logits([step.last_node]).float(), -1).max())

    def _sample(self, evidence, observed, span: int, n: int):
        """A window [span] drawn from the circuit of e given the kept bytes (its first `n` bytes
        read), and the function giving its conditionals log q(X_i | window[:i])."""
        m, head = len(self.given), self.model.head
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
        if self.tree is not None:
            self._observe_tree(step)
        kept_bonus = bool(step.new_tokens) and len(step.new_tokens) > len(step.accepted)
        if kept_bonus and not self.sampling:
            self.e, self.given = None, []   # the paper's branch: a state-only cycle comes next
            return
        self.given = [step.new_tokens[-1]] if kept_bonus else []
        if self.model.draft is None:
            self.e = step.hidden[step.last_node]  # the last accepted draft byte, or the root (0)
            return
        # rows of the forward: the context positions, then the step's nodes (node i at row
        # context_len - 1 + i); a tree's accepted path is not contiguous, so the draft layers get
        # the context rows they have not seen, then the accepted nodes' rows in path order
        first = self.length - step.context_len        # absolute position of row 0
        upto = self.length - 1 + len(step.accepted)   # absolute position of the newest byte with a state
        if upto >= self.cached:
            path = [step.context_len - 1 + i for i in step.accepted]
            if path == list(range(step.context_len, step.context_len + len(path))):  # a chain's: one slice
                rows = step.shared_hidden[self.cached - first: upto - first + 1][None]
            else:
                rows = torch.cat([step.shared_hidden[self.cached - first: step.context_len],
                                  step.shared_hidden[path]])[None]
            positions = torch.arange(self.cached, upto + 1, device=rows.device)[None]
            with torch.no_grad():
                e = self.model.draft(rows, positions, past_key_values=self.cache)
            self.cached = upto + 1
            self.e = e[0, -1]
