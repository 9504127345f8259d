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
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from mtpkit.models.decoding.drafter import Draft, Drafter, StepOutput
from mtpkit.models.decoding.step import StepOptions
from mtpkit.models.head_folder import recorded_backbone
from mtpkit.models.medusa.head import load_head, read_settings
from mtpkit.models.medusa.model import MedusaConfig, MedusaHeads
from mtpkit.models.medusa.trees import choose_tree
from mtpkit.models.trees import check_ranks, compile_topology


@dataclass
class MedusaDraftConfig(StepOptions):
    head: str = ""
    """head folder (train/export.py output or a checkpoint's head/) of Medusa or Hydra heads"""
    tree: str = ""
    """the draft: '' = the top-1 chain of every head; mc_sim_7b_63 (also medusa_default,
    hydra_default: both papers' published default, 63 nodes, 4 deep: needs 4 heads); chainN; a
    JSON list of rank paths like [[0],[1],[0,0]] (inline or in a .json file); or a bank written by
    eval/tree_frontier.py. A wide tree pays where a step's extra rows cost little (a GPU); on a
    CPU a short chain"""
    index: int = -1
    """tree=a bank: its tree to decode with (-1 = the static tree calibrated for `task`, else tree 0)"""
    task: str = ""
    """tree=a bank: the task whose calibrated static tree to use ('' = the first)"""
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

    def _check(self, settings: MedusaConfig, vocab_size: int | None) -> None:
        if self.arch is not None and settings.arch != self.arch:
            raise ValueError(f"{self.arch}:head={self.config.head}: the folder holds {settings.arch} heads; use "
                             f"{settings.arch}:head=...")
        self.name = settings.arch
        # the prefix layer reads the final states of every position the step accepted, prompt
        # included: transformers ties the last entry of hidden_states to last_hidden_state
        self.shared_layer = -1 if settings.prefix_layer else None
        self.topology = choose_tree(self.config.tree, settings.heads, self.config.task, self.config.index)
        if isinstance(vocab_size, int):
            check_ranks([self.topology], vocab_size, f"{settings.arch} tree={self.config.tree!r}")
        self.compiled = compile_topology(self.topology, 0)

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
        self.bonus = None
        self.length = 0  # tokens in the sequence before the current step
        self.cached = 0  # positions the prefix layer has processed
        self.cache = DynamicCache() if self.model.prefix is not None else None
        if self.indices_device != target.device:
            self._build_indices(target.device)

    def _build_indices(self, device) -> None:
        """The tree as index tensors on `device`, built once: Medusa's (depth, rank) of every node;
        Hydra's per depth (its nodes, each node's parent row, its rank, every parent's path)."""
        t, c = self.topology, self.compiled
        self.width = t.max_rank
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
        self.depth_index = as_tensor([d - 1 for d in t.depths])
        self.rank_index = as_tensor(t.ranks)
        self.levels = []
        for nodes, parents in c.levels:
            where = {p: i for i, p in enumerate(parents)}
            paths = []
            for p in parents:  # the step nodes root .. p
                path, node = [], p
                while node:
                    path.append(node)
                    node = t.parents[node - 1]
                paths.append([0] + path[::-1])
            self.levels.append((as_tensor(nodes), as_tensor([where[t.parents[j - 1]] for j in nodes]),
                                as_tensor([t.ranks[j - 1] for j in nodes]), as_tensor(paths)))
        self.indices_device = device

    def propose(self, tokens: list[int]) -> Draft:
        self.length = len(tokens)
        if self.h is None or not self.topology.num_nodes:
            return Draft.empty()
        with torch.no_grad():
            draft = self._hydra_tokens() if self.model.hydra else self._medusa_tokens()
        c = self.compiled
        return Draft(tokens=draft, parents=c.parents, layout=c.layout, children=c.children)

    def _medusa_tokens(self) -> torch.Tensor:
        """[N] tokens on the device: the D heads' states through the LM head in one call (one read of
        its weight), then node (r_1..r_d) = the r_d-th token of head d."""
        m, D = self.model, self.topology.depth
        z = torch.cat([m.hidden(i, self.h[None]) for i in range(D)])  # [D, d]
        if m.proj is None:
            logits = m.logits(0, z, self.target.lm_head)  # [D, V]
        else:
            logits = torch.cat([m.logits(i, z[i: i + 1]) for i in range(D)])
        top = logits.topk(self.width, dim=-1).indices  # [D, width]
        return top[self.depth_index, self.rank_index]

    def _hydra_tokens(self) -> torch.Tensor:
        """[N] tokens on the device, depth by depth: head d on every parent's path tokens (the bonus
        first), node = the r_d-th token of its parent's row."""
        m, N = self.model, self.topology.num_nodes
        node_tokens = torch.empty(1 + N, dtype=torch.long, device=self.h.device)
        node_tokens[:1] = self.target.upload([self.bonus])
        for i, (nodes, parent_row, ranks, paths) in enumerate(self.levels):
            z = m.hidden(i, self.h.expand(len(paths), -1), node_tokens[paths])  # [P, d]
            top = m.logits(i, z, self.target.lm_head).topk(self.width, dim=-1).indices  # [P, width]
            node_tokens[nodes] = top[parent_row, ranks]
        return node_tokens[1:]

    def observe(self, step: StepOutput) -> None:
        self.bonus = step.new_tokens[-1]
        if self.model.prefix is None:
            self.h = step.hidden[step.last_node]  # [d]: its next token is the bonus
            return
        # the prefix layer over the positions it has not seen: the context rows (the prompt, then
        # each step's root), then the accepted nodes in path order (a tree's path is not contiguous)
        first = self.length - step.context_len  # absolute position of the forward's row 0
        upto = self.length - 1 + len(step.accepted)  # the deepest accepted node's position
        path = [step.context_len - 1 + i for i in step.accepted]
        rows = torch.cat([step.shared_hidden[self.cached - first: step.context_len], step.shared_hidden[path]])
        positions = torch.arange(self.cached, upto + 1, device=rows.device)[None]
        with torch.no_grad():
            self.h = self.model.prefix(rows[None], positions, past_key_values=self.cache)[0, -1]
        self.cached = upto + 1
