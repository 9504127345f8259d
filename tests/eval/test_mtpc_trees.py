"""Draft trees of the MTPC drafter (`tree=`): greedy nodes are the ranks of the circuit's exact
conditionals and the output stays token-identical to AR (with tree drafts, off the rank-0 path
too, accepted, and the LoRA draft layers' state exact along a tree path); under speculative
sampling, siblings drawn without replacement and verified with the renormalised q keep the target
distribution, which plain q for every sibling does not (the same test, failing); bad trees are
refused naming `tree`."""

import json

import pytest
import torch

from chisquare import chi2_pvalue
from mtpkit.eval.bench import parse_method
from mtpkit.models.decoding.decoder import Target, decode
from mtpkit.models.decoding.drafter import Drafter
from mtpkit.models.mtpc.circuits import greedy_chain, next_log_probs
from mtpkit.models.mtpc.draft_trees import load_tree
from mtpkit.models.mtpc.drafter import MTPCDraftConfig, MTPCDrafter
from tests.eval.test_host_syncs import BOUNDS, device_target, reads_per_step
from tests.eval.test_mtpc_decoding import (PROMPT, OracleMTPC, exact_two_token_joint, make_head,  # noqa: F401
                                            small, two_token_counts)

BRANCHY = "[[0],[1],[0,0],[0,1],[1,0]]"
WIDE = "[[0],[1],[2],[0,0],[0,1],[1,0]]"


class OracleTree(OracleMTPC):
    """The real tree drafter whose tokens along one seeded random root-to-leaf path are replaced by
    the true continuation, corrupted at a seeded random depth (or not at all), so branches off the
    rank-0 path are accepted. Every time it drafts, its e_t must equal the draft features
    recomputed over the whole sequence (the LoRA draft layers fed a tree path's rows)."""

    def __init__(self, truth, model, seed, **options):
        super().__init__(truth, model, seed, **options)
        self.off_rank0 = 0

    def propose(self, tokens):
        draft = MTPCDrafter.propose(self, tokens)
        if self.e is None:
            return draft
        self.check_state(tokens)
        parents = list(draft.parents)
        leaves = [j for j in range(1, len(parents) + 1) if j not in parents]
        node, path = leaves[int(torch.randint(len(leaves), (1,), generator=self.gen_oracle))], []
        while node:
            path.insert(0, node)
            node = parents[node - 1]
        spec = self.truth_after(tokens, len(path))
        draft.tokens = draft.tokens.clone()
        draft.tokens[[j - 1 for j in path[: len(spec)]]] = torch.tensor(spec, dtype=torch.long)
        return draft

    def observe(self, step):
        self.off_rank0 += any(self.tree.ranks[j - 1] for j in step.accepted)
        super().observe(step)


@pytest.mark.parametrize("arch,L", [("ff", 0), ("btree", 0), ("btree", 1), ("hmm", 1)])
def test_greedy_tree_drafts_equal_ar(tiny_byte, arch, L):
    backbone, _ = tiny_byte
    head = make_head(backbone, arch, L)
    target = Target(backbone)
    prompt = [5, 17, 99, 3, 8]
    want = decode(target, Drafter(), prompt, 40).tokens
    for tree in (BRANCHY, "chain3"):
        got = decode(target, MTPCDrafter(MTPCDraftConfig(tree=tree), model=head), prompt, 40)
        assert got.tokens == want and got.draft_nodes > 0
        oracle = OracleTree(want, head, seed=0, tree=tree)
        got = decode(target, oracle, prompt, 40)
        assert got.tokens == want and sum(got.accept_counts) > 0 and len(got.accept_counts) >= 2, got.accept_counts
        assert oracle.checked > 3
        assert oracle.off_rank0 > 0 or tree == "chain3"  # a branch off the top-1 path was accepted


@pytest.mark.parametrize("arch,kept", [("btree", 0), ("cp", 1), ("cirkit", 0)])
def test_greedy_nodes_rank_the_exact_conditionals(tiny_byte, arch, kept):
    """Each node's byte is its rank in q(x_d | kept bytes, parent path) computed by brute force (V
    upward passes, not the closed form the drafter uses); the rank-0 path is the circuit's
    `greedy_chain` (a kept byte: the window after a rejection)."""
    backbone, _ = tiny_byte
    head = make_head(backbone, arch, 0)
    target, prompt = Target(backbone), [5, 17, 99, 3, 8]
    tree = "[[0],[1],[2],[0,0],[0,1],[1,0],[2,0],[0,0,0]]"
    drafter = MTPCDrafter(MTPCDraftConfig(tree=tree), model=head)
    drafter.begin(target, prompt)
    drafter.e, drafter.given = head.features(torch.tensor([prompt]))[0, -1], [7] * kept
    tokens = drafter.propose(prompt).tokens.tolist()
    params, m = head.head(drafter.e[None]), len(drafter.given)
    for j, path in enumerate(drafter.tree.paths):
        window = torch.zeros(1, params.n, dtype=torch.long)
        window[0, :m] = torch.tensor(drafter.given, dtype=torch.long)
        for depth in range(1, len(path)):
            window[0, m + depth - 1] = tokens[drafter.tree.paths.index(path[:depth])]
        with torch.no_grad():
            log_q = next_log_probs(params, window, m + len(path) - 1)[0]
        top = log_q.sort(descending=True, stable=True)
        torch.testing.assert_close(log_q[tokens[j]], top.values[path[-1]], msg=f"{path}: {tokens[j]} {top.indices[:3]}")
    rank0 = [tokens[drafter.tree.paths.index((0,) * d)] for d in range(1, 4)]
    evidence = torch.zeros(1, params.n, dtype=torch.long)
    evidence[0, :m] = 7
    with torch.no_grad():
        chain = greedy_chain(params, evidence, torch.arange(params.n)[None] < m)[0, m: m + 3]
    assert rank0 == chain.tolist()


def sampled_tree_pvalue(small, arch, L, T, far):
    """Chi-square p-value of 800 two-byte samples drafted with the WIDE tree against the exact
    joint. far: the head's unembeddings random instead of from the target's LM head, so its q is
    far from p and rank 0 is often rejected (siblings then matter most)."""
    head = make_head(small, arch, L, n=4, seed=4)
    if far:
        with torch.no_grad():
            head.head.unembed.copy_(torch.randn(head.head.unembed.shape, generator=torch.Generator().manual_seed(5)))
    drafter = MTPCDrafter(MTPCDraftConfig(seed=1, tree=WIDE), model=head)
    counts = two_token_counts(Target(small), drafter, 800, T)
    return chi2_pvalue(counts, exact_two_token_joint(small, T)), drafter


@pytest.mark.parametrize("arch,L,T,far", [("btree", 0, 1.0, True), ("btree", 0, 1.0, False), ("hmm", 1, 0.7, False),
                                          ("cp", 0, 0.7, True)])
def test_speculative_sampling_with_a_tree_is_exact(small, arch, L, T, far):
    """Siblings drawn without replacement, each verified with q less its earlier siblings' bytes:
    the two-byte joint is the target's (depths 1 and 2 of the tree, and the branching under a
    bonus byte kept after a rejection)."""
    pvalue, drafter = sampled_tree_pvalue(small, arch, L, T, far)
    assert pvalue > 1e-3
    # the drafts were the tree's, siblings distinct, each q row zero at its earlier siblings' bytes
    drafter.sampling, drafter.temperature = True, T
    drafter.begin(Target(small), PROMPT)
    drafter.e, drafter.given = drafter.model.features(torch.tensor([PROMPT]))[0, -1], []
    draft = drafter.propose(PROMPT)
    x, q = draft.tokens.tolist(), draft.draft_probs
    assert len(set(x[:3])) == 3 and x[3] != x[4]  # (0), (1), (2); (0,0), (0,1)
    assert q[1, x[0]] == 0 and q[2, x[0]] == 0 and q[2, x[1]] == 0 and q[4, x[3]] == 0
    torch.testing.assert_close(q.sum(-1), torch.ones(6))
    res = decode(Target(small), drafter, PROMPT, 30, temperature=T, generator=torch.Generator().manual_seed(9))
    assert sum(res.accept_counts) > 0 and res.draft_nodes > res.target_calls


def test_siblings_verified_with_plain_q_fail_the_same_test(small, monkeypatch):
    """Power check: verifying every sibling with the plain conditional q (not renormalised over
    the bytes not drawn yet) is biased, and the first case of the test above catches it."""
    plain = lambda q, order: q[:, None].expand(-1, order.shape[1], -1)  # noqa: E731
    monkeypatch.setattr("mtpkit.models.mtpc.draft_trees.sibling_probs", plain)
    pvalue, _ = sampled_tree_pvalue(small, "btree", 0, 1.0, far=True)
    assert pvalue < 1e-6


def test_bad_trees_are_refused(tiny_byte, tmp_path):
    backbone, _ = tiny_byte
    head = make_head(backbone, "btree", 0, n=4)
    bank = tmp_path / "bank.json"
    bank.write_text(json.dumps({"trees": [{"paths": [[0], [1]]}, {"paths": [[0], [0, 0]]}]}))
    for bad in ("chainx", "[[0], [-1]]", "[[0]", "[0, 1]", "[]", "tree.json", str(tmp_path)):
        with pytest.raises(ValueError, match="tree="):
            MTPCDrafter(MTPCDraftConfig(tree=bad), model=head)
    with pytest.raises(ValueError, match="index=2"):
        MTPCDrafter(MTPCDraftConfig(tree=str(bank), index=2), model=head)
    with pytest.raises(ValueError, match="tree='chain5': depth 5"):  # deeper than the window
        MTPCDrafter(MTPCDraftConfig(tree="chain5"), model=head)
    with pytest.raises(ValueError, match="tree=.*verify=path"):
        MTPCDrafter(MTPCDraftConfig(tree="chain2", verify="path"), model=head)
    ema = {"kind": "hyst", "trees": [0, 1], "thresholds": [0.2, 0.3], "signal": "ema", "alpha": 0.5}
    bank.write_text(json.dumps({"trees": [{"paths": [[0], [1]]}, {"paths": [[0], [0, 0]]}],
                                "schedules": {"t": {"hyst": ema}}}))
    with pytest.raises(ValueError, match="signal 'ema'"):  # MTPC schedules read the path value
        MTPCDrafter(MTPCDraftConfig(tree=str(bank), schedule="hyst"), model=head)
    MTPCDrafter(MTPCDraftConfig(tree="chain4"), model=head)  # as deep as the window: fine


def test_trees_on_the_bench_command_line(tmp_path):
    """On the bench command line a tree is chainN, an inline JSON list (its commas stay inside the
    brackets), or a file (a list of rank paths, or a bank and its index)."""
    assert parse_method("mtpc:head=DIR,tree=chain3")[1].tree == "chain3"
    inline = parse_method(f"mtpc:head=DIR,tree={BRANCHY},n=4")[1]
    assert (inline.tree, inline.n, inline.head) == (BRANCHY, 4, "DIR")
    paths = tmp_path / "branchy.json"
    paths.write_text(BRANCHY)
    bank = tmp_path / "bank.json"
    bank.write_text(json.dumps({"trees": [{"paths": [[0]]}, {"paths": json.loads(BRANCHY)}]}))
    name, options = parse_method(f"mtpc:head=DIR,tree={bank},index=1")
    assert (name, options.tree, options.index) == ("mtpc", str(bank), 1)
    want = load_tree(BRANCHY).paths
    assert load_tree(str(paths)).paths == want and load_tree(options.tree, options.index).paths == want


def test_tree_drafts_stay_on_the_device(tiny_byte):
    """On the device path a greedy tree step reads the host no more often than a chain's (the
    tree's bytes, ranks and prefixes are device tensors; its shape is host data)."""
    backbone, _ = tiny_byte
    prompt = list(range(40, 60))
    truth = decode(Target(backbone), Drafter(), prompt, 40).tokens
    drafter = MTPCDrafter(MTPCDraftConfig(tree=BRANCHY), model=make_head(backbone, "btree", 1))
    steps, result = reads_per_step(device_target(backbone), drafter, prompt)
    assert result.tokens == truth and result.draft_nodes > 0
    assert max(steps) <= BOUNDS["mtpc"], steps
