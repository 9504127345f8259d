"""Draft trees of the gated-LoRA drafter (mtpkit.models.trees, tree= / schedule=), and the
acceptance simulator of eval/tree_frontier.py against the real decoder.

The head is tests/eval/test_gated_sampling.py's `close_head` (a 5-token target, a head whose
candidates are close to the target's): drafts are accepted at every depth, and branches matter."""

import json
from pathlib import Path

import pytest
import torch

from chisquare import chi2_pvalue
from mtpkit.eval import tree_frontier as tf
from mtpkit.eval.tree_search.calibration import Calibration, calibrate
from mtpkit.eval.tree_search.growth import grow
from mtpkit.eval.tree_search.pricing import cost_curve, tokens_per_s
from mtpkit.eval.tree_search.schedules import NEVER, calibrate_schedules, frontier, oracle, schedule_pool
from mtpkit.eval.tree_search.simulate import accept_length, rollout
from mtpkit.models.decoding.decoder import Target, decode
from mtpkit.models.decoding.drafter import Drafter
from mtpkit.models.gated_lora.drafter import GatedLoRADraftConfig, GatedLoRADrafter
from mtpkit.models.schedules import Schedule
from mtpkit.models.trees import Topology, TopologyBank, load_bank, parse_paths, tree_layout
from tests.eval.test_gated_sampling import PROMPT, close_head, exact_joint, sampled_joint, small  # noqa: F401

BRANCHY = "[[0],[1],[0,0],[0,1],[1,0]]"
PROMPTS = [PROMPT, [1, 2], [4, 0, 2, 2], [3], [2, 4, 1, 0, 0]]
EMA_THRESHOLDS = [0.6, 0.65]  # (tau_off, tau_on) of the EMA signal, inside the range it takes on PROMPTS


def test_topologies_from_paths():
    assert parse_paths("chain3") == [(0,), (0, 0), (0, 0, 0)]
    assert parse_paths([[1, 0]]) == [(1,), (1, 0)]  # prefixes added, nothing else
    t = Topology([[0, 1], [1]], blocks="chain")
    assert t.paths == [(0,), (1,), (0, 1)] and t.parents == [0, 0, 1] and t.depths == [1, 1, 2]
    assert t.block_nodes == [0, 1]  # the root and (0,), the top-1 path
    assert Topology([[0, 1], [1]], blocks="all").block_nodes == [0, 1, 2, 3]
    assert t.rows(k=2) == 1 + 3 + 2 * 2
    assert Topology([[0, 1], [1]], blocks="leaf").block_nodes == [2, 3]  # the leaves (1,) and (0, 1), no root
    assert Topology("chain2", blocks="leaf").block_nodes == [2]  # linear decoding's block
    assert Topology([], blocks="leaf").block_nodes == [0]  # an empty tree's only leaf is the root
    for bad, match in [("chainx", "chainN"), ("[[0], [-1]]", "non-negative"), ("[[0]", "JSON")]:
        with pytest.raises(ValueError, match=match):
            Topology(bad)
    with pytest.raises(ValueError, match="blocks"):
        Topology("chain2", blocks="some")


def test_the_bank_compiles_the_decoders_layout():
    bank = TopologyBank([Topology("chain2"), Topology(BRANCHY, blocks="all")], k=2)
    for c in bank.compiled:
        allowed, depth = c.layout
        want_allowed, want_depth = tree_layout(c.full_parents)
        assert torch.equal(allowed, want_allowed) and torch.equal(depth, want_depth)
        assert len(c.full_parents) == c.topology.rows(2)
    assert bank.get(1) is bank.compiled[1]  # a switch is an index


def test_schedules():
    ladder = Schedule("ladder", [0, 1, 2], [0.2, 0.6])
    assert [ladder.next(0, v) for v in (0.1, 0.2, 0.5, 0.7)] == [0, 1, 1, 2]
    hyst = Schedule("hyst", [0, 1], [0.3, 0.6])
    steps, pos = [], 0
    for v in (0.5, 0.7, 0.5, 0.4, 0.2, 0.5, 0.65):
        pos = hyst.next(pos, v)
        steps.append(pos)
    assert steps == [0, 1, 1, 1, 0, 0, 1]  # on at >= 0.6, off below 0.3 only
    with pytest.raises(ValueError, match="tau_off"):
        Schedule("hyst", [0, 1], [0.7, 0.6])
    with pytest.raises(ValueError, match="thresholds"):
        Schedule("ladder", [0, 1, 2], [0.5])
    ema = Schedule("hyst", [0, 1], [0.3, 0.6], signal="ema", alpha=0.75)
    assert ema.smooth(None, [0.2]) == 0.2 and ema.smooth(0.2, [1.0, 0.6]) == pytest.approx(0.75 * 0.4 + 0.25 * 0.6)
    assert Schedule(**ema.to_json()) == ema and "signal" not in hyst.to_json()
    with pytest.raises(ValueError, match="signal"):
        Schedule("hyst", [0, 1], [0.3, 0.6], signal="sum")
    with pytest.raises(ValueError, match="alpha"):
        Schedule("hyst", [0, 1], [0.3, 0.6], signal="ema", alpha=1.0)


def _bank(tmp_path, trees, schedules=None) -> str:
    path = tmp_path / "bank.json"
    path.write_text(json.dumps({"trees": [t.to_json() for t in trees], "schedules": {"t": schedules or {}}}))
    return str(path)


@pytest.mark.parametrize("tree,blocks,sampler", [("chain2", "chain", True), (BRANCHY, "chain", False),
                                                 (BRANCHY, "chain", True), (BRANCHY, "all", True),
                                                 (BRANCHY, "root", False), ("chain2", "leaf", True),
                                                 (BRANCHY, "leaf", False)])
def test_greedy_trees_equal_ar_and_the_simulator_predicts_every_step(small, tmp_path, tree, blocks, sampler):
    """Greedy decoding with a tree is AR's output, drafts are accepted (at depth 2 too), and the
    simulator's rollout of the teacher-forced calibration takes exactly the decoder's steps."""
    head = close_head(small)
    bank = _bank(tmp_path, [Topology(tree, blocks)])
    drafter = GatedLoRADrafter(GatedLoRADraftConfig(tree=bank, sampler=sampler), model=head)
    target = Target(*drafter.adapt(None, {}))
    cals, calls, accepted = [], 0, [0, 0]
    for prompt in PROMPTS:
        want = decode(Target(small), Drafter(), prompt, 20).tokens
        got = decode(target, drafter, prompt, 20)
        assert got.tokens == want
        calls += got.target_calls
        for d, n in enumerate(got.accept_counts[:2]):
            accepted[d] += n
        cals.append(calibrate(head, prompt + want, len(prompt), "t", sampler, max_rank=4))
    assert accepted[0] > 10 and accepted[1] > 3, accepted
    sim = rollout(cals, [Topology(tree, blocks)], k=2)
    assert (sim.steps, sim.tokens) == (calls, 20 * len(PROMPTS))


@pytest.mark.parametrize("blocks,decoding", [("leaf", "linear"), ("chain", "quadratic")])
def test_a_chain_tree_decodes_as_the_chain_decoding(small, blocks, decoding):
    """tree=chain2 with leaf blocks IS linear decoding (k = 2), with chain blocks quadratic
    decoding: the same tokens, steps and acceptances, step by step (inline tree, blocks=)."""
    head = close_head(small)
    tree = GatedLoRADrafter(GatedLoRADraftConfig(tree="chain2", blocks=blocks, sampler=False), model=head)
    chain = GatedLoRADrafter(GatedLoRADraftConfig(decoding=decoding, k=2, sampler=False), model=head)
    target = Target(*tree.adapt(None, {}))
    def run(drafter, prompt):  # the decode and every draft it proposed
        proposed, propose = [], drafter.propose
        drafter.propose = lambda tokens: proposed.append(propose(tokens)) or proposed[-1]
        try:
            return decode(target, drafter, prompt, 20), proposed
        finally:
            del drafter.propose

    empty = 0
    for prompt in PROMPTS:
        (a, a_drafts), (b, b_drafts) = run(tree, prompt), run(chain, prompt)
        assert a.tokens == b.tokens == decode(Target(small), Drafter(), prompt, 20).tokens
        assert (a.target_calls, a.accept_counts) == (b.target_calls, b.accept_counts)
        assert [list(d.tokens) for d in a_drafts] == [list(d.tokens) for d in b_drafts]
        assert [len(d.extra_parents) for d in a_drafts] == [len(d.extra_parents) for d in b_drafts]
        empty += sum(len(d.tokens) == 0 for d in a_drafts[1:])
    assert (empty > 0) == (blocks == "leaf")  # linear: a step after a rejection drafts nothing


def test_blocks_option_is_checked(small, tmp_path):
    head = close_head(small)
    with pytest.raises(ValueError, match="blocks must be one of"):
        GatedLoRADrafter(GatedLoRADraftConfig(tree="chain2", blocks="leaves"), model=head)
    with pytest.raises(ValueError, match="blocks=leaf is for a single tree"):
        GatedLoRADrafter(GatedLoRADraftConfig(tree=_bank(tmp_path, [Topology("chain1")]), blocks="leaf"), model=head)
    from mtpkit.models.probe import ProbeConfig, ProbeDrafter
    with pytest.raises(ValueError, match="probe blocks=leaf: mask-block placement is for a rank tree"):
        ProbeDrafter(ProbeConfig(blocks="leaf"))
    with pytest.raises(SystemExit):
        tf.parse_args(["--head", "x", "--data", "builtin:eval", "--out", "b.json", "--blocks", "chain,leaves"])


@pytest.mark.parametrize("kind,device_path,value_depth,order,signal", [
    ("ladder", False, 0, [0, 1], "path"), ("hyst", False, 0, [0, 1], "path"), ("hyst", True, 0, [0, 1], "path"),
    ("hyst", False, 1, [0, 1], "path"), ("hyst", False, 0, [1, 0], "path"), ("hyst", False, 0, [0, 1], "ema"),
    ("hyst", True, 0, [1, 0], "ema")])
def test_schedules_switch_trees_exactly_as_simulated(small, tmp_path, kind, device_path, value_depth, order, signal):
    """A schedule's steps are the simulator's, on the CPU path and on the device path (what a GPU
    runs: `cpu_paths` off, one host read per greedy step), with the path value over the whole
    block or its first `value_depth` masks, with hyst's bigger tree below tau_on, and on the EMA
    signal (the target's top-1 probability averaged over the generated tokens)."""
    head = close_head(small)
    trees = [Topology("chain1"), Topology(BRANCHY)]
    thresholds = [0.25] if kind == "ladder" else [0.2, 0.3] if signal == "path" else EMA_THRESHOLDS
    schedule = {"kind": kind, "trees": order, "thresholds": thresholds, "value_depth": value_depth,
                **({"signal": "ema", "alpha": 0.6} if signal == "ema" else {})}
    log = tmp_path / "steps.jsonl"
    entry = {**schedule, "sim_tau": 1.5, "sim_tokens_per_s": 20.0}  # as eval/tree_frontier.py writes it
    drafter = GatedLoRADrafter(GatedLoRADraftConfig(tree=_bank(tmp_path, trees, {kind: entry}), schedule=kind,
                                                    sampler=False, log=str(log)), model=head)
    target = Target(*drafter.adapt(None, {}))
    target.cpu_paths = not device_path
    cals, calls = [], 0
    for prompt in PROMPTS:
        want = decode(Target(small), Drafter(), prompt, 20).tokens
        got = decode(target, drafter, prompt, 20)
        assert got.tokens == want
        calls += got.target_calls
        cals.append(calibrate(head, prompt + want, len(prompt), "t", False, max_rank=4))
    used = [json.loads(line)["tree"] for line in log.read_text().splitlines()]
    assert {0, 1} <= set(used), "the schedule never switched: nothing tested"
    sim = rollout(cals, trees, 2, Schedule(**schedule))
    assert sim.steps == calls
    assert [u for u in sim.trees_used if u is not None] == [u for u in used if u is not None]


@pytest.mark.parametrize("temperature,sampler", [(1.0, True), (0.7, False)])
def test_under_sampling_the_rollout_of_the_output_takes_the_decoders_steps(small, tmp_path, temperature, sampler):
    """A tree's drafts are one-hot, so speculative sampling accepts a node iff the sampled token is
    the node's: the steps are a function of the output, and the simulator's rollout of a
    calibration on the decoder's own sampled output takes exactly the decoder's steps."""
    head = close_head(small)
    tree = Topology(BRANCHY)
    drafter = GatedLoRADrafter(GatedLoRADraftConfig(tree=_bank(tmp_path, [tree]), sampler=sampler), model=head)
    target = Target(*drafter.adapt(None, {}))
    cals, calls, accepted, outputs = [], 0, [0, 0], set()
    for seed in range(3):
        for i, prompt in enumerate(PROMPTS):
            got = decode(target, drafter, prompt, 20, temperature=temperature,
                         generator=torch.Generator().manual_seed(100 * seed + i))
            calls += got.target_calls
            for d, n in enumerate(got.accept_counts[:2]):
                accepted[d] += n
            outputs.add(tuple(got.tokens))
            cals.append(calibrate(head, prompt + got.tokens, len(prompt), "t", sampler, max_rank=4))
    assert accepted[0] > 20 and accepted[1] > 5, accepted
    greedy = [decode(Target(small), Drafter(), prompt, 20).tokens for prompt in PROMPTS]
    assert len(outputs) > len(PROMPTS) and not outputs <= {tuple(g) for g in greedy}  # truly sampled
    sim = rollout(cals, [tree], k=2)
    assert (sim.steps, sim.tokens) == (calls, 20 * len(cals))


@pytest.mark.parametrize("temperature,sampler", [(1.0, True), (0.7, False)])
def test_sampling_with_a_tree_is_exact(small, tmp_path, temperature, sampler):
    """Speculative sampling over a branching tree of top-ranked drafts: the first 3 tokens follow
    the target's joint, and drafts were accepted at depth 1 and 2."""
    drafter = GatedLoRADrafter(GatedLoRADraftConfig(tree=_bank(tmp_path, [Topology(BRANCHY)]), sampler=sampler),
                               model=close_head(small))
    target = Target(*drafter.adapt(None, {}))
    counts, accepted = sampled_joint(target, drafter, 1000, temperature, 1.0)
    assert accepted[0] > 200 and accepted[1] > 50, accepted
    assert chi2_pvalue(counts, exact_joint(small, temperature, 1.0)) > 1e-3


def test_grown_trees_are_scored_and_the_frontier_is_non_dominated(small):
    head = close_head(small)
    cals = []
    for prompt in PROMPTS:
        want = decode(Target(small), Drafter(), prompt, 20).tokens
        cals.append(calibrate(head, prompt + want, len(prompt), "t", False, max_rank=3))
    grown, _ = grow(cals, k=2, max_nodes=5, max_rank=3, blocks="chain")
    assert [t.num_nodes for t in grown] == [1, 2, 3, 4, 5]
    assert all(set(a.paths) < set(b.paths) for a, b in zip(grown, grown[1:]))  # one node at a time
    taus = [rollout(cals, [t], 2).tau for t in grown]
    assert taus[-1] > taus[0] > 1.0
    kept = frontier(grown, [1.0, 3.0, 2.0, 4.0, 4.0])
    assert kept == [0, 1, 3]


def close_calibrations(small) -> list:
    """The simulator's calibration of `close_head` on PROMPTS (AR's 20-token continuations, ranks up to 3)."""
    head = close_head(small)
    return [calibrate(head, p + decode(Target(small), Drafter(), p, 20).tokens, len(p), "t", False, max_rank=3)
            for p in PROMPTS]


def test_schedules_over_both_placements_of_one_size(small):
    """The 1-node tree with leaf blocks (linear decoding: 3 rows a step with 1-mask blocks) and with
    chain blocks (4 rows): as many nodes, so the ladder orders them by rows; hyst pairs them either way."""
    cals = close_calibrations(small)
    trees = [Topology("chain1", "leaf", name="leaf1"), Topology("chain1", "chain", name="chain1")]
    costs = {"prefill": 1.0, "ar": 1.0, "none@1": 1.1, "leaf1@1": 1.2, "chain1@1": 1.4}
    out = calibrate_schedules(cals, trees, [1, 0], 2, costs, 0.8)
    assert out["ladder"]["trees"] == [0, 1]  # leaf (3 rows) first
    # hyst pairs them in both orders: here the chain tree on the doubtful steps (its root block
    # proposes again after a rejection) and the leaf tree on the confident ones pays
    assert out["hyst"]["trees"] == [1, 0] and 0 < out["hyst"]["thresholds"][1] < NEVER
    assert out["hyst"]["sim_tokens_per_s"] > out["static"]["sim_tokens_per_s"]
    assert out["hyst"]["sim_tokens_per_s"] <= oracle(cals, trees, [0, 1], costs)["sim_tokens_per_s"]
    assert frontier(trees, [2.0, 3.0]) == [1] and frontier(trees, [3.0, 2.0]) == [0]  # a tie: the better


def test_hyst_is_swept_on_both_signals_and_keeps_the_faster(small):
    """With EMA alphas the hyst sweep also pairs the trees on the EMA signal: each signal's best is
    in `by_signal`, hyst is the faster one, and its simulated speed is its schedule's rollout."""
    cals = close_calibrations(small)
    trees = [Topology("chain1", "leaf", name="leaf1"), Topology("chain1", "chain", name="chain1")]
    costs = {"prefill": 1.0, "ar": 1.0, "none@1": 1.1, "leaf1@1": 1.2, "chain1@1": 1.4}
    out = calibrate_schedules(cals, trees, [1, 0], 2, costs, 0.8, ema_alphas=(0.3, 0.8))
    signals = out["hyst"]["by_signal"]
    assert set(signals) == {"path", "ema"} and signals["ema"]["signal"] == "ema"
    assert signals["ema"]["alpha"] in (0.3, 0.8) and "signal" not in signals["path"]
    best = max(signals.values(), key=lambda b: b["sim_tokens_per_s"])
    assert out["hyst"]["sim_tokens_per_s"] == best["sim_tokens_per_s"] and out["hyst"]["trees"] == best["trees"]
    for b in signals.values():
        entry = {name: b[name] for name in ("kind", "trees", "thresholds", "signal", "alpha") if name in b}
        sim = rollout(cals, trees, 2, Schedule(**entry))
        assert round(tokens_per_s(sim, cals, costs, trees), 2) == b["sim_tokens_per_s"]
    assert "by_signal" not in calibrate_schedules(cals, trees, [1, 0], 2, costs, 0.8)["hyst"]


def test_hyst_is_never_calibrated_below_its_conservative_tree(small):
    """A switch to the aggressive tree that pays on no threshold: the sweep's end (never switch
    on) keeps hyst on the static tree, so in simulation it is exactly as fast."""
    cals = close_calibrations(small)
    trees = [Topology("chain1", "leaf", name="leaf1"), Topology("chain1", "chain", name="chain1")]
    costs = {"prefill": 1.0, "ar": 1.0, "none@1": 1.1, "leaf1@1": 1.2, "chain1@1": 3.0}
    out = calibrate_schedules(cals, trees, [1, 0], 2, costs, 0.8)
    assert out["static"]["trees"] == [0] and out["hyst"]["trees"] == [0, 1]
    assert out["hyst"]["thresholds"][1] == NEVER
    assert out["hyst"]["sim_tokens_per_s"] == out["static"]["sim_tokens_per_s"]


def test_hyst_falls_back_to_a_shallower_static_tree(small):
    """The static tree is 1 deep and every pair holds a 2-deep tree, whose 2-mask blocks make the
    1-deep tree dearer: no pair reaches the static tree, so hyst is that tree alone, exactly as
    fast in simulation."""
    cals = close_calibrations(small)
    trees = [Topology("chain1", "leaf", name="leaf1"), Topology("chain2", "chain", name="chain2")]
    costs = {"prefill": 1.0, "ar": 1.0, "none@1": 1.1, "none@2": 1.5, "leaf1@1": 1.2, "leaf1@2": 2.0,
             "chain2@2": 3.0}
    out = calibrate_schedules(cals, trees, [0, 1], 2, costs, 0.8)
    assert out["static"]["trees"] == [0] and out["hyst"]["trees"] == [0, 0]
    assert out["hyst"]["sim_tokens_per_s"] == out["static"]["sim_tokens_per_s"]


def test_the_future_known_bound(small):
    """`oracle`: with one chain-block tree cheaper than the root's block alone, drafting every step
    is optimal, so the bound is that tree's rollout exactly; it bounds every calibrated schedule;
    plain AR steps, when cheap, raise it."""
    cals = close_calibrations(small)
    trees = [Topology("chain1", "leaf", name="leaf1"), Topology("chain2", "chain", name="chain2")]
    costs = {"prefill": 1.0, "ar": 1.0, "none@1": 1.4, "leaf1@1": 1.2, "none@2": 1.5, "leaf1@2": 1.3,
             "chain2@2": 1.4, "draft:chain2@2": 0.05}
    sim = rollout(cals, trees, 2, Schedule("static", [1]))
    bound = oracle(cals, trees, [1], costs)
    assert bound["sim_tau"] == round(sim.tau, 4) and sim.tau > 1.3  # drafts accepted
    assert bound["sim_tokens_per_s"] == round(tokens_per_s(sim, cals, costs, trees), 2)
    schedules = calibrate_schedules(cals, trees, [0, 1], 2, costs, 0.8)
    both = oracle(cals, trees, [0, 1], costs)
    assert all(s["sim_tokens_per_s"] <= both["sim_tokens_per_s"] for s in schedules.values())
    cheap_ar = oracle(cals, trees, [0, 1], {**costs, "ar": 0.2}, ar_steps=True)
    assert cheap_ar["sim_tokens_per_s"] > both["sim_tokens_per_s"]
    assert oracle(cals, trees, [0, 1], costs, ar_steps=True)["sim_tokens_per_s"] >= both["sim_tokens_per_s"]


def test_the_future_known_bound_is_the_best_of_every_choice_sequence():
    """`oracle` against an exhaustive search over every sequence of step choices (a pool tree,
    the root's block alone, a plain AR step) on short calibrations with random ranks."""
    gen = torch.Generator().manual_seed(0)
    cals = [Calibration("t", 3, n, torch.randint(0, 3, (n, 2), generator=gen), torch.ones(n), torch.ones(n, 2))
            for n in (7, 9, 10)]
    trees = [Topology("chain2", "leaf", name="leaf2"), Topology("[[0],[1],[0,0]]", "leaf", name="branchy")]
    costs = {"prefill": 2.0, "ar": 1.0, "none@2": 1.5, "leaf2@2": 1.45, "branchy@2": 1.7, "draft:branchy@2": 0.1}

    def fastest(cal, j, has, ar_steps):  # (seconds, steps) to finish from anchor j, every choice tried
        if j >= cal.n - 1:
            return 0.0, 0
        moves = [(costs["none@2"], 1, True)] + ([(costs["ar"], 1, False)] if ar_steps else [])
        if has:
            for t in trees:
                L = accept_length(t, cal.ranks[j].tolist())
                node = t.index[tuple(cal.ranks[j, :L].tolist())] if L else 0
                moves.append((costs[f"{t.name}@2"] + costs.get(f"draft:{t.name}@2", 0.0), L + 1, node in t.block_nodes))
        return min((c + s, 1 + n) for c, new, h in moves for s, n in [fastest(cal, j + new, h, ar_steps)])

    for ar_steps in (False, True):
        best = [fastest(cal, 0, True, ar_steps) for cal in cals]
        tokens = sum(cal.n for cal in cals)
        want = tokens / (len(cals) * costs["prefill"] + sum(s for s, _ in best))
        bound = oracle(cals, trees, [0, 1], costs, ar_steps)
        assert bound["sim_tokens_per_s"] == round(want, 2)
        assert bound["sim_tau"] == round(tokens / (len(cals) + sum(n for _, n in best)), 4)


def test_the_schedules_pool_keeps_the_fastest_trees():
    """A frontier longer than --pool-size (on a GPU more nodes keep paying): the pool keeps the
    fastest trees, so the best static tree is in it, not the smallest ones."""
    trees = [Topology(f"chain{d}") for d in range(1, 5)] + [Topology("[[0],[1],[0,0],[0,0,0],[0,0,0,0],[1,0]]")]
    speeds = [40.0, 44.0, 46.0, 50.0, 55.0]  # every larger tree faster: all on the frontier
    taus = [1.4, 1.6, 1.7, 1.8, 2.0]
    kept, pool = schedule_pool(trees, speeds, taus, pool_speed=0.8, pool_size=3)
    assert kept == [0, 1, 2, 3, 4]
    assert pool == [2, 3, 4]  # the three fastest, ordered by nodes
    kept, pool = schedule_pool(trees, [40.0, 44.0, 43.0, 42.0, 41.0], taus, pool_speed=0.9, pool_size=3)
    assert kept == [0, 1] and pool == [1, 2, 3]  # tau-frontier trees within 90% of the fastest join


def test_step_costs_are_read_off_one_cost_curve():
    """Shapes with the same rows (body Q, LM head L, gated) share one pooled median, and the
    medians are non-decreasing in the work (ratio * Q + L), gated and ungated forwards apart; a
    lone shape keeps its own median."""
    rows = {"ar": (1, 1, False), "none@1": (2, 2, True), "a@1": (3, 3, True), "b@1": (3, 3, True),
            "c@2": (4, 4, True), "d@2": (5, 5, True), "e@3": (20, 6, True)}
    samples = {"ar": [50.0], "none@1": [20.0, 21.0, 22.0], "a@1": [30.0, 31.0], "b@1": [24.0, 25.0],
               "c@2": [26.0], "d@2": [40.0], "e@3": [39.0]}
    costs = cost_curve(samples, rows, ratio=4.0)
    assert costs["ar"] == 50.0  # ungated: not pooled with (nor held below) the gated forwards
    assert costs["none@1"] == 21.0 and costs["a@1"] == costs["b@1"]  # equal rows, one median
    assert costs["c@2"] == costs["a@1"] == (27.5 * 4 + 26.0) / 5  # 26 < 27.5: pooled by weight
    assert costs["d@2"] == costs["e@3"] == 39.5  # e (20 body rows, 6 head rows) is more work than d
    order = sorted(rows, key=lambda n: 4.0 * rows[n][0] + rows[n][1])
    gated = [costs[n] for n in order if rows[n][2]]
    assert gated == sorted(gated)


def test_bad_tree_options_are_clear(small, tmp_path):
    head = close_head(small)
    with pytest.raises(ValueError, match="no such file"):
        GatedLoRADrafter(GatedLoRADraftConfig(tree=str(tmp_path / "missing.json")), model=head)
    with pytest.raises(ValueError, match="no calibrated 'hyst'"):
        GatedLoRADrafter(GatedLoRADraftConfig(tree=_bank(tmp_path, [Topology("chain1")]), schedule="hyst"), model=head)
    drafter = GatedLoRADrafter(GatedLoRADraftConfig(tree="chain3"), model=head)
    with pytest.raises(ValueError, match="depth 3 needs 3 masks, the drafter has 2"):
        drafter.begin(None, [1])


def test_tree_frontier_and_bench_end_to_end(tmp_path, monkeypatch):
    """eval/tree_frontier.py on the tiny backbone writes a bank (trees, per-task schedules, step
    costs on the packed kernels the bench decodes with, the gated copy on its own plan, switch
    costs, the held-out check), its table and plot; the bench then decodes with the bank's trees,
    outputs identical to AR."""
    import copy

    from mtpkit.eval import bench
    from mtpkit.models.backbone import load_backbone
    from mtpkit.models.gated_lora import GatedLoRAConfig, GatedMTP, save_head

    base, _ = load_backbone("tiny-llama-random")
    save_head(GatedMTP(copy.deepcopy(base), GatedLoRAConfig(k=2, rank=4)), tmp_path / "head", "tiny-llama-random")
    monkeypatch.setattr("mtpkit.models.packed_linear.MIN_PACK", 0)  # the tiny model's layers get packed too
    out = tmp_path / "trees" / "bank.json"
    report = tf.main(["--backbone", "tiny-llama-random", "--head", str(tmp_path / "head"), "--data", "builtin:eval",
                      "--per-category", "3", "--holdout", "1", "--max-new-tokens", "12", "--budgets", "1,2",
                      "--rounds", "2", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["trees"] and set(saved["schedules"]) == {"chat", "code", "math", "summarisation"}
    assert all("static" in s for s in saved["schedules"].values())
    checked = [t["name"] for t in saved["check"]["trees"]]
    assert saved["check"]["prompts"] == 4 and {t["name"] for t in saved["trees"]} <= set(checked)
    assert saved["check"]["matches_ar"] and saved["device"] == "cpu" and saved["dtype"] == "float32"
    assert saved["linear"] == "auto" and len(saved["kernels"]["adapted"]) == 1  # the gated copy's own plan
    assert "on the kernel plan of this machine (the gated copy's own)" in out.with_suffix(".md").read_text()
    assert len(checked) == 2  # every searched tree (t0_1n, t1_2n; chain1 and chain2 are those), up to 6
    assert set(saved["switch_cost"]) == {"choose_tree_us", "mask_from_bank_us", "mask_rebuilt_us"}
    assert {f"draft:{t['name']}@2" for t in saved["trees"]} <= set(saved["costs_ms"])  # drafting is priced
    assert set(saved["measured_ms"]) == set(saved["costs_ms"])
    assert all(saved["costs_ms"][n] == saved["measured_ms"][n] for n in saved["costs_ms"]  # only forwards fitted
               if n.startswith("draft:") or n == "prefill")
    assert "step costs read off the cost curve" in out.with_suffix(".md").read_text()
    assert out.with_suffix(".md").read_text().count("| tree | nodes |") == 5 and out.with_suffix(".png").stat().st_size
    assert report["k"] == 2
    for task in saved["tasks"].values():  # the future-known bound, with and without AR steps
        static = task["schedules"]["static"]["sim_tokens_per_s"]
        assert static <= task["oracle"]["sim_tokens_per_s"] <= task["oracle_ar"]["sim_tokens_per_s"]
    assert out.with_suffix(".md").read_text().count("The future known") == 4
    results = tmp_path / "bench" / "results.json"
    spec = f"gated_lora:head={tmp_path / 'head'},tree={out},schedule=static,task=code"
    bench.main(["--backbone", "tiny-llama-random", "--data", "builtin:eval", "--per-category", "1",
                "--max-new-tokens", "12", "--methods", spec, "--out", str(results), "--linear", "stock"])
    assert json.loads(results.read_text())["methods"][spec]["matches_ar"] is True
    with pytest.raises(SystemExit):
        tf.main(["--head", "x", "--data", "builtin:eval", "--out", "bank.txt"])


def test_the_calibration_pass_is_saved_and_read_again(tmp_path, monkeypatch):
    """--calibrations: the first run writes the pass, the second reads it instead of calibrating
    (the same simulated taus), also with the head copied elsewhere; other options, another dtype,
    a changed head or a broken file are refused by name."""
    import copy
    import shutil

    from mtpkit.models.backbone import load_backbone
    from mtpkit.models.gated_lora import GatedLoRAConfig, GatedMTP, save_head

    base, _ = load_backbone("tiny-llama-random")
    save_head(GatedMTP(copy.deepcopy(base), GatedLoRAConfig(k=2, rank=4)), tmp_path / "head", "tiny-llama-random")
    cal_file = tmp_path / "cal.pt"
    argv = ["--backbone", "tiny-llama-random", "--head", str(tmp_path / "head"), "--data", "builtin:eval",
            "--per-category", "2", "--holdout", "1", "--max-new-tokens", "10", "--budgets", "1,2", "--rounds", "2",
            "--calibrations", str(cal_file)]
    first = tf.main(argv + ["--out", str(tmp_path / "a.json")])
    assert cal_file.is_file()

    def no_calibration(*args, **kwargs):
        raise AssertionError("calibrated again")

    monkeypatch.setattr("mtpkit.eval.tree_search.subjects.calibrate", no_calibration)
    second = tf.main(argv + ["--out", str(tmp_path / "b.json")])
    for task, entry in first["tasks"].items():
        assert [r["sim_tau"] for r in second["tasks"][task]["trees"]] == [r["sim_tau"] for r in entry["trees"]]
    # the head is keyed by its files, not its path: a copy elsewhere (another machine) reads the pass
    shutil.copytree(tmp_path / "head", tmp_path / "moved")
    moved = tf.main([a if a != str(tmp_path / "head") else str(tmp_path / "moved") for a in argv]
                    + ["--check-trees", "0", "--out", str(tmp_path / "m.json")])
    assert "check" in first and "check" not in moved  # --check-trees 0: priced, held-out prompts not decoded
    with pytest.raises(SystemExit, match="other dtype"):
        tf.main(argv + ["--dtype", "bfloat16", "--out", str(tmp_path / "bf.json")])
    (tmp_path / "moved" / "mtpkit_config.json").write_text(
        (tmp_path / "moved" / "mtpkit_config.json").read_text() + " ")
    with pytest.raises(SystemExit, match="other head_digest"):
        tf.main([a if a != str(tmp_path / "head") else str(tmp_path / "moved") for a in argv]
                + ["--out", str(tmp_path / "m2.json")])
    with pytest.raises(SystemExit, match="other max_new_tokens"):
        tf.main([a if a != "10" else "11" for a in argv] + ["--out", str(tmp_path / "c.json")])
    cal_file.write_bytes(b"not a calibration")
    with pytest.raises(SystemExit, match="not a calibration file"):
        tf.main(argv + ["--out", str(tmp_path / "d.json")])


def test_tree_frontier_under_sampling(tmp_path):
    """--temperature: calibration on the target's samples, the check decodes with sampling and
    replays the decoder's own outputs, which take exactly its steps; the table says so."""
    import copy

    from mtpkit.models.backbone import load_backbone
    from mtpkit.models.gated_lora import GatedLoRAConfig, GatedMTP, save_head

    base, _ = load_backbone("tiny-llama-random")
    save_head(GatedMTP(copy.deepcopy(base), GatedLoRAConfig(k=2, rank=4)), tmp_path / "head", "tiny-llama-random")
    out = tmp_path / "bank.json"
    tf.main(["--backbone", "tiny-llama-random", "--head", str(tmp_path / "head"), "--data", "builtin:eval",
             "--per-category", "2", "--holdout", "1", "--max-new-tokens", "10", "--budgets", "1,2", "--rounds", "2",
             "--temperature", "0.8", "--seed", "3", "--blocks", "chain,leaf", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["temperature"] == 0.8 and saved["check"]["replay_exact"]
    assert any(t["name"].endswith("_leaf") for t in saved["check"]["trees"])  # both placements searched
    assert all(r["replay_steps"] == r["decoded_steps"] > 4 for r in saved["check"]["trees"])
    assert "speculative sampling at T = 0.8" in out.with_suffix(".md").read_text()


def test_the_shipped_tree_files_load():
    """configs/trees/*.json (the documented `tree=FILE` trees): each loads as one topology; the
    24-node tree of docs/gated_lora.md has 8 candidates at depth 1 and 45 rows on 4-mask blocks."""
    files = sorted((Path(__file__).resolve().parents[2] / "configs" / "trees").glob("*.json"))
    assert files
    for f in files:
        trees, schedules = load_bank(str(f))
        assert len(trees) == 1 and schedules == {}
    sparse, _ = load_bank(str(files[0].with_name("sparse24.json")))
    t = sparse[0]
    assert t.num_nodes == 24 and t.depth == 4 and sum(d == 1 for d in t.depths) == 8 and t.rows(4) == 45
