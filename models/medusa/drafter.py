"""The Medusa / Hydra drafter: a chain or tree of the heads' top-ranked tokens, proposed from the
hidden state the verifier already computed, verified in the next single target forward.

After each step the state h of the deepest accepted node (the row whose argmax, or sample, is
the bonus token) is what the heads read: head i proposes the token i + 1 after the bonus, so a
step feeds [bonus (the root), the tree's nodes] and nothing else (no mask rows: drafting costs
the heads and their vocabulary projections, not target rows). The tree is a `Topology` of rank
paths (`mtpkit.models.medusa.trees`: the published default `mc_sim_7b_63`, chainN, rank paths,
a bank's tree), laid out once (`compile_topology`: parents, children, the tree attention layout).

- Medusa ("Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads",
  arXiv:2401.10774, Sec. 2.1.2): the D heads' states go through the LM head in one call, [D, V];
  node (r_1..r_d) = the r_d-th token of head d, gathered with precomputed index tensors.
- Hydra ("Hydra: Sequentially-Dependent Draft Heads for Medusa Decoding", arXiv:2402.05109):
  depth by depth, head d runs once per distinct parent at depth d - 1 on the tokens of that
  parent's path (the bonus first); a node is the r_d-th token of its parent's row.

With Hydra++'s prefix layer the heads read its output e_t instead of h_t: the drafter keeps the
layer's own KV cache of the accepted tokens and, after each step, runs it over the positions the
step accepted (the whole prompt after the prefill), whose final states the verifier returns
(`shared_hidden`); rejected nodes never reach that cache.

Either way the draft tokens are computed and stay on the target's device (a tensor in the
`Draft`; the verifier reads them with its acceptance decision): a step reads nothing back to the
host for drafting. The drafts are deterministic top-k candidates, which speculative sampling
verifies as one-hot proposals (SpecInfer's multi-candidate rule): greedy output equals AR and
sampled output follows the target's distribution (tests/eval/test_medusa_decoding.py).

Tree schedules (`tree=bank.json,task=T,schedule=ladder|hyst`, a bank written by
`eval/tree_frontier.py --method medusa|hydra`; EntMTP, "EntMTP: Accelerating LLM Inference with
Entropy Guided Multi Token Prediction", arXiv:2606.27550, Sec. 4): after each step the schedule
(`mtpkit.models.schedules`) picks the next tree by its signal at the deepest accepted node:
`path` / `path_sum`, EAGLE-2's path values V_d = p_0 p_1 ... p_d with p_0 the target's top-1
probability there and p_d head d's top-1 probability along the heads' greedy chain (Hydra: head d
given the bonus and the chain's d - 1 tokens), D deep (the deepest scheduled tree, or the
schedule's `value_depth`); `entropy`, the smoothed entropy of the target there; `accept`, the
smoothed accept length (host data). On the device path those numbers are computed on the device
before the decoder's one read and travel in it (`step_signal`); on the CPU path, and for Hydra++'s
path values (the prefix layer runs after acceptance), `observe` reads them itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from mtpkit.models.decoding.drafter import Draft, Drafter, StepOutput
from mtpkit.models.screen import ScreenedHead
from mtpkit.models.head_folder import recorded_backbone
from mtpkit.models.medusa.head import load_head, read_settings
from mtpkit.models.medusa.model import MedusaConfig, MedusaHeads
from mtpkit.models.medusa.trees import choose_trees
from mtpkit.models.schedules import entropy, path_signal
from mtpkit.models.trees import TreeOptions, check_ranks, compile_topology


@dataclass
class MedusaDraftConfig(TreeOptions):
    head: str = ""
    """head folder (train/export.py output or a checkpoint's head/) of Medusa or Hydra heads"""
    tree: str = ""
    """the draft: '' = the top-1 chain of every head; mc_sim_7b_63 (also medusa_default,
    hydra_default: both papers' published default, 63 nodes, 4 deep: needs 4 heads); chainN; a
    JSON list of rank paths like [[0],[1],[0,0]] (inline or in a .json file); or a bank written by
    eval/tree_frontier.py --method medusa|hydra, whose trees `schedule` switches (ladder, hyst) or
    fixes (static: `index`, else the task's calibrated tree). A wide tree pays where a step's extra
    rows cost little (a GPU); on a CPU a short chain"""
    # schedule, task, index, log: `TreeOptions` (mtpkit.models.trees)
    allow_other_backbone: bool = False
    """run the heads on a backbone other than the one they were trained on (refused otherwise; the
    bench marks the row)"""


class MedusaDrafter(Drafter):
    name = "medusa"

    def __init__(self, config: MedusaDraftConfig = MedusaDraftConfig(), model: MedusaHeads | None = None,
                 arch: str | None = None):
        """`arch`: the method the drafter was asked for by name (medusa or hydra), checked against
        the head's; None takes the head's."""
        if model is None and not config.head:
            raise ValueError(f"{arch or 'medusa'} needs head=DIR (a folder written by train/export.py)")
        self.config, self.model, self.arch = config, model, arch
        if model is not None:
            self._check(model.cfg, model.adapter.vocab_size)
        else:  # the head's settings checked now, before any model loads
            head_config, settings = read_settings(config.head)
            self._check(settings, recorded_backbone(head_config).get("vocab_size"))
        self.indices_device = None  # the device the index tensors were built on
        self.tree_log = None
        self.screen = self.screens = None  # the shared LM head's bf16 screen (`_top`), made at the first `begin` on a CPU

    def _check(self, settings: MedusaConfig, vocab_size: int | None) -> None:
        if self.arch is not None and settings.arch != self.arch:
            raise ValueError(f"{self.arch}:head={self.config.head}: the folder holds {settings.arch} heads; use "
                             f"{settings.arch}:head=...")
        self.name = settings.arch
        # the prefix layer reads the final states of every position the step accepted, prompt
        # included: transformers ties the last entry of hidden_states to last_hidden_state
        self.shared_layer = -1 if settings.prefix_layer else None
        self.trees, self.schedule = choose_trees(self.config, settings.heads, settings.arch)
        scheduled = sorted(set(self.schedule.trees))
        if isinstance(vocab_size, int):
            check_ranks([self.trees[i] for i in scheduled], vocab_size, f"{settings.arch} tree={self.config.tree!r}")
        self.compiled = {i: compile_topology(self.trees[i], 0) for i in scheduled}
        self.deepest = max(self.trees[i].depth for i in scheduled)
        s = self.schedule  # the decoder reads the signal with its decision, but for `accept` (host data)
        # and Hydra++'s path values (the heads read the prefix layer's output, made in `observe`)
        self.wants_signal = s.switches and s.signal != "accept" and (s.signal == "entropy" or not settings.prefix_layer)
        self.topology = self.trees[self.schedule.trees[0]]  # the tree of the next draft

    def adapt(self, model, shared: dict):
        """The heads loaded (once per head folder) on the target's device and in its dtype; the
        target itself is unchanged."""
        if self.model is None:
            key = ("medusa", self.config.head)
            if key not in shared:
                weight = model.get_input_embeddings().weight
                heads = load_head(self.config.head, model, allow_other_backbone=self.config.allow_other_backbone)
                shared[key] = heads.to(weight.device, weight.dtype)
            self.model = shared[key]
            self._check(self.model.cfg, self.model.adapter.vocab_size)
        self.model.eval()
        return model, None

    def begin(self, target, prompt_ids: list[int]) -> None:
        self.target = target
        self.h = None  # the heads' input at the deepest accepted node (None: nothing to draft from yet)
        self.bonus = self.bonus_ids = None
        self.length = 0  # tokens in the sequence before the current step
        self.cached = 0  # positions the prefix layer has processed
        self.cache = DynamicCache() if self.model.prefix is not None else None
        self.position = self.schedule.start()  # index into schedule.trees
        self.topology = self.trees[self.schedule.trees[self.position]]
        self.ema = None  # entropy, accept: the running average (None until the first observation)
        self.drafted = False  # whether the step in flight drafted (from a state)
        if self.indices_device != target.device:
            self.indices = {i: self._build_indices(i, target.device) for i in self.compiled}
            self.indices_device = target.device
        if getattr(target, "cpu_paths", True) and self.model.proj is None:
            self.screens = ScreenedHead.of(target.lm_head, self.screens)
            self.screen = self.screens
        else:
            self.screen = None
        if self.config.log and self.tree_log is None:  # line-buffered: one line per step, kept on a crash
            self.tree_log = open(self.config.log, "a", buffering=1)

    def _build_indices(self, index: int, device) -> tuple:
        """Tree `index` as index tensors on `device`, built once: its width, Medusa's (depth, rank)
        of every node, Hydra's per depth (its nodes, each node's parent row, its rank, every
        parent's path)."""
        t, c = self.trees[index], self.compiled[index]
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
        levels = []
        for nodes, parents in c.levels:
            where = {p: i for i, p in enumerate(parents)}
            paths = []
            for p in parents:  # the step nodes root .. p
                path, node = [], p
                while node:
                    path.append(node)
                    node = t.parents[node - 1]
                paths.append([0] + path[::-1])
            levels.append((as_tensor(nodes), as_tensor([where[t.parents[j - 1]] for j in nodes]),
                           as_tensor([t.ranks[j - 1] for j in nodes]), as_tensor(paths)))
        return t.max_rank, as_tensor([d - 1 for d in t.depths]), as_tensor(t.ranks), levels

    def propose(self, tokens: list[int]) -> Draft:
        self.length = len(tokens)
        self.drafted = self.h is not None
        index = self.schedule.trees[self.position]
        self.topology = self.trees[index]
        if self.h is None or not self.topology.num_nodes:
            return Draft.empty()
        with torch.no_grad():
            draft = self._hydra_tokens(index) if self.model.hydra else self._medusa_tokens(index)
        c = self.compiled[index]
        return Draft(tokens=draft, parents=c.parents, layout=c.layout, children=c.children)

    def _medusa_states(self, h: torch.Tensor, depth: int) -> torch.Tensor:
        """[depth, d]: the first `depth` heads' states at h [1, d]."""
        return torch.cat([self.model.hidden(i, h) for i in range(depth)])

    def _medusa_logits(self, h: torch.Tensor, depth: int) -> torch.Tensor:
        """[depth, V]: the first `depth` heads' logits at h [1, d], through the LM head in one call
        (one read of its weight)."""
        m = self.model
        z = self._medusa_states(h, depth)
        if m.proj is None:
            return m.logits(0, z, self.target.lm_head)
        return torch.cat([m.logits(i, z[i: i + 1]) for i in range(depth)])

    def _top(self, i: int, z: torch.Tensor, width: int) -> torch.Tensor:
        """The `width` best tokens [R, width] of head i's logits at z [R, d], best first: on a CPU
        from the bf16 screen of the shared LM head (`ScreenedHead`: the float32 ranking, read at
        half the bytes; one LM-head read per depth is most of a draft's cost), else from the logits."""
        if self.screen is not None:
            return self.screen.topk(z.float(), width)
        return self.model.logits(i, z, self.target.lm_head).topk(width, dim=-1).indices

    def _medusa_tokens(self, index: int) -> torch.Tensor:
        """[N] tokens on the device: node (r_1..r_d) = the r_d-th token of head d."""
        width, depth_index, rank_index, _ = self.indices[index]
        if self.screen is not None:  # every head's state through one screen (one read of the LM head)
            top = self._top(0, self._medusa_states(self.h[None], self.topology.depth), width)
        else:
            top = self._medusa_logits(self.h[None], self.topology.depth).topk(width, dim=-1).indices  # [D, width]
        return top[depth_index, rank_index]

    def _hydra_tokens(self, index: int) -> torch.Tensor:
        """[N] tokens on the device, depth by depth: head d on every parent's path tokens (the bonus
        first), node = the r_d-th token of its parent's row."""
        m, N = self.model, self.topology.num_nodes
        width, _, _, levels = self.indices[index]
        node_tokens = torch.empty(1 + N, dtype=torch.long, device=self.h.device)
        node_tokens[:1] = self._bonus_ids()
        for i, (nodes, parent_row, ranks, paths) in enumerate(levels):
            z = m.hidden(i, self.h.expand(len(paths), -1), node_tokens[paths])  # [P, d]
            top = self._top(i, z, width)  # [P, width]
            node_tokens[nodes] = top[parent_row, ranks]
        return node_tokens[1:]

    def _bonus_ids(self) -> torch.Tensor:
        """[1] the bonus on the device (uploaded once a step)."""
        if self.bonus_ids is None:
            self.bonus_ids = self.target.upload([self.bonus])
        return self.bonus_ids

    def _chain_top1(self, h: torch.Tensor, bonus: torch.Tensor, depth: int) -> torch.Tensor:
        """[depth] p_1..p_depth: each head's top-1 probability along the heads' greedy chain from h
        [1, d] (Medusa: head d's alone, `bonus` unused; Hydra: head d given the bonus [1] and the
        chain's top-1 tokens before it)."""
        m = self.model
        if not depth:
            return h.new_zeros(0, dtype=torch.float)
        if not m.hydra:
            return torch.softmax(self._medusa_logits(h, depth).float(), -1).amax(-1)
        tokens, out = bonus.view(1, 1), []
        for i in range(depth):
            top = torch.softmax(m.logits(i, m.hidden(i, h, tokens), self.target.lm_head).float(), -1).max(-1)
            out.append(top.values)
            tokens = torch.cat([tokens, top.indices[:, None]], -1)
        return torch.cat(out)

    def _signal_inputs(self, h: torch.Tensor, logits: torch.Tensor, bonus: torch.Tensor) -> torch.Tensor:
        """What the schedule's signal reads at the deepest accepted node, on the device: entropy, the
        target's entropy there [1]; path, path_sum, [p_0, p_1..p_D] (p_0 the target's top-1
        probability there, `logits` [1, V]; `_chain_top1` from the heads' input h [1, d])."""
        if self.schedule.signal == "entropy":
            return entropy(logits)
        p0 = torch.softmax(logits.float(), -1).amax(-1)  # [1]
        return torch.cat([p0, self._chain_top1(h, bonus, self.schedule.depth_of_value(self.deepest))])

    def step_signal(self, hidden: torch.Tensor, logits: torch.Tensor, bonus: torch.Tensor) -> torch.Tensor:
        """The signal's numbers (`_signal_inputs`), read with the decoder's acceptance decision
        (asked for where `wants_signal`)."""
        return self._signal_inputs(hidden, logits, bonus)

    def _next_tree(self, step: StepOutput) -> float | None:
        """Move the schedule on after `step` by its signal; returns the signal's value v."""
        s = self.schedule
        if s.signal == "accept":  # a drafted step's tokens: its accepted drafts and the bonus
            if self.drafted:
                self.ema = s.smooth(self.ema, [len(step.accepted) + 1])
            value = s.value(self.ema)
        else:
            read = step.signal
            if read is None:  # the CPU path (or Hydra++'s prefix state): one read here
                bonus = self._bonus_ids() if self.model.hydra else None
                read = self._signal_inputs(self.h[None], step.logits([step.last_node]), bonus).tolist()
            if s.signal == "entropy":
                self.ema = s.smooth(self.ema, read)
                value = s.value(self.ema)
            else:
                value = path_signal(s.signal, read[0], read[1:])
        self.position = s.next(self.position, value)
        return value

    def observe(self, step: StepOutput) -> None:
        self.bonus, self.bonus_ids = step.new_tokens[-1], None
        if self.model.prefix is None:
            self.h = step.hidden[step.last_node]  # [d]: its next token is the bonus
        else:
            # the prefix layer over the positions it has not seen: the context rows (the prompt, then
            # each step's root), then the accepted nodes in path order (a tree's path is not contiguous)
            first = self.length - step.context_len  # absolute position of the forward's row 0
            upto = self.length - 1 + len(step.accepted)  # the deepest accepted node's position
            path = [step.context_len - 1 + i for i in step.accepted]
            rows = torch.cat([step.shared_hidden[self.cached - first: step.context_len],
                              step.shared_hidden[path]])
            positions = torch.arange(self.cached, upto + 1, device=rows.device)[None]
            with torch.no_grad():
                self.h = self.model.prefix(rows[None], positions, past_key_values=self.cache)[0, -1]
            self.cached = upto + 1
        used = self.schedule.trees[self.position] if self.drafted else None
        value = None
        if self.schedule.switches:
            with torch.no_grad():
                value = self._next_tree(step)
        if self.tree_log is not None:
            self.tree_log.write(json.dumps({"tree": used, "accepted": len(step.accepted), "value": value,
                                            "next": self.schedule.trees[self.position]}) + "\n")
