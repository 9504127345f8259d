"""The schedules' run-time signals (mtpkit.models.trees: path, path_sum, entropy, accept, ema) and
EntMTP's Appendix B pair (the one-step biased and the self-rollout mean accept length of a tree).

Each signal is checked by hand on numbers chosen for it, in the simulator on a hand-built
calibration, and through the real decoder (gated LoRA's `close_head`, tests/eval/test_gated_trees.py's
fixtures): greedy output equal to AR with drafts accepted, the schedule switching trees exactly
as the simulator does, and no more host reads a step than the path value's."""

import json
import math

import pytest
import torch

from mtpkit.eval.tree_search.calibration import MISS, Calibration, calibrate
from mtpkit.eval.tree_search.growth import biased_tau, candidate_trees, grow, self_tau
from mtpkit.eval.tree_search.report import appendix_b
from mtpkit.eval.tree_search.schedules import build_bank, calibrate_schedules
from mtpkit.eval.tree_search.simulate import path_value, rollout
from mtpkit.models.decoding.decoder import Target, decode
from mtpkit.models.decoding.drafter import Drafter
from mtpkit.models.decoding.host_reads import counting_reads
from mtpkit.models.gated_lora.drafter import GatedLoRADraftConfig, GatedLoRADrafter
from mtpkit.models.schedules import Schedule, entropy, path_signal
from mtpkit.models.trees import Topology
from decoding_checks import decode_equal_to_ar
from tests.eval.test_gated_sampling import close_head, small  # noqa: F401
from tests.eval.test_gated_trees import BRANCHY, PROMPTS, _bank


def test_path_signals_by_hand():
    """V_d = p_0 p_1 ... p_d: path is V_D, path_sum is V_1 + ... + V_D; they differ."""
    assert path_signal("path", 0.9, [0.8, 0.5]) == pytest.approx(0.9 * 0.8 * 0.5)
    assert path_signal("path_sum", 0.9, [0.8, 0.5]) == pytest.approx(0.9 * 0.8 + 0.9 * 0.8 * 0.5)
    assert path_signal("path_sum", 1.0, [0.5, 0.5, 0.5]) == pytest.approx(0.5 + 0.25 + 0.125)
    assert path_signal("path", 0.7, []) == pytest.approx(0.7) and path_signal("path_sum", 0.7, []) == 0.0
    with pytest.raises(ValueError, match="not a path signal"):
        path_signal("entropy", 1.0, [0.5])


def test_entropy_by_hand():
    uniform = torch.zeros(4)
    assert float(entropy(uniform)) == pytest.approx(math.log(4))
    two = torch.log(torch.tensor([0.75, 0.25]))
    assert float(entropy(two)) == pytest.approx(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25)))
    peaked = torch.tensor([[30.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # rows: nearly one-hot, uniform
    assert entropy(peaked).tolist() == pytest.approx([0.0, math.log(3)], abs=1e-6)


def test_smoothed_signals_by_hand():
    s = Schedule("hyst", [0, 1], [0.3, 0.4], signal="entropy", alpha=0.5)
    average = s.smooth(None, [1.0])
    assert average == 1.0 and s.smooth(average, [2.0]) == pytest.approx(1.5)
    assert s.value(1.5) == pytest.approx(math.exp(-1.5))  # higher where the entropy is lower
    a = Schedule("hyst", [0, 1], [1.5, 2.0], signal="accept", alpha=0.25)
    assert a.value(a.smooth(a.smooth(None, [3]), [1])) == pytest.approx(0.25 * 3 + 0.75 * 1)
    assert a.next(1, None) == 1 and a.next(0, None) == 0  # nothing observed yet: the current tree
    for signal in ("path_sum", "entropy", "accept"):
        entry = Schedule("ladder", [0, 1], [0.5], signal=signal, alpha=0.5 if signal != "path_sum" else 0.0)
        assert Schedule(**entry.to_json()) == entry and entry.to_json()["signal"] == signal
    with pytest.raises(ValueError, match="signal"):
        Schedule("hyst", [0, 1], [0.3, 0.6], signal="sum")


def heads_cal(n: int, ranks: dict[int, list[int]] | None = None, target_top1=None, head_top1=None,
              target_entropy=None) -> Calibration:
    """A Medusa/Hydra calibration (every node drafts next) of n tokens, k = 2: true tokens top-1
    (rank 0) at every depth unless `ranks` says otherwise."""
    r = torch.zeros(n, 2, dtype=torch.long)
    for j, row in (ranks or {}).items():
        r[j] = torch.tensor(row)
    return Calibration("t", 3, n, r, torch.ones(n) if target_top1 is None else torch.tensor(target_top1),
                       torch.ones(n, 2) if head_top1 is None else torch.tensor(head_top1), cycle="heads",
                       target_entropy=None if target_entropy is None else torch.tensor(target_entropy))


TREES = [Topology("chain1"), Topology("chain2")]


def test_the_simulator_reads_each_signal_as_defined():
    """Hand-worked rollouts of chain1 / chain2 under hyst on each signal (chain1 accepts 1 draft a
    step, chain2 2, where the true tokens are top-1)."""
    # path vs path_sum at anchor 0: p_0 = 1, p = (0.5, 0.5): V_2 = 0.25 < 0.5 <= V_1 + V_2 = 0.75
    cal = heads_cal(6, head_top1=[[0.5, 0.5]] * 6)
    assert path_value(cal, 0, 2) == 0.25 and path_value(cal, 0, 2, signal="path_sum") == 0.75
    assert path_value(cal, 0, 1, signal="path_sum") == 0.5  # the value depth cuts the sum too
    on = {"kind": "hyst", "trees": [0, 1], "thresholds": [0.5, 0.5]}
    assert rollout([cal], TREES, 2, Schedule(**on)).trees_used[0] == 0
    assert rollout([cal], TREES, 2, Schedule(**on, signal="path_sum")).trees_used[0] == 1

    # entropy: the bigger tree where H' <= 1 nat (v = exp(-H') >= exp(-1)); alpha 0: H at the anchor
    # alone. Anchors: 0 (H 3: chain1, 2 tokens) -> 2 (H 0.5: chain2, 3 tokens) -> 5 (H 3: chain1) -> 7
    H = [3.0, 3.0, 0.5, 3.0, 3.0, 3.0, 3.0, 3.0]
    cal = heads_cal(8, target_entropy=H)
    t = math.exp(-1.0)
    sim = rollout([cal], TREES, 2, Schedule("hyst", [0, 1], [t, t], signal="entropy", alpha=0.0))
    assert sim.anchors == [(0, 0), (0, 2), (0, 5)] and sim.trees_used == [0, 1, 0]
    # alpha 0.5: at anchor 2, H' = 0.5 * 3 + 0.5 * 0.5 = 1.75 > 1: chain1 stays
    sim = rollout([cal], TREES, 2, Schedule("hyst", [0, 1], [t, t], signal="entropy", alpha=0.5))
    assert sim.trees_used == [0, 0, 0, 0] and sim.anchors == [(0, 0), (0, 2), (0, 4), (0, 6)]

    # accept (alpha 0: the last drafted step's tokens): none yet at anchor 0 -> chain1 (2 tokens);
    # a = 2 >= tau_on -> chain2 at 2, rejected at depth 1 (1 token); a = 1 < tau_off -> chain1 at 3
    # (2 tokens) -> chain2 at 5 (3 tokens) -> chain2 at 8
    cal = heads_cal(10, ranks={2: [MISS, 0]})
    sim = rollout([cal], TREES, 2, Schedule("hyst", [0, 1], [1.5, 2.0], signal="accept", alpha=0.0))
    assert sim.anchors == [(0, 0), (0, 2), (0, 3), (0, 5), (0, 8)]
    assert sim.trees_used == [0, 1, 0, 1, 1] and sim.accepted == [1, 0, 1, 2, 2]

    mtpc = Calibration("t", 3, 4, torch.zeros(4, 2, dtype=torch.long), torch.ones(4), torch.ones(4, 2), cycle="alg2",
                       window=4, target_entropy=torch.zeros(4))
    for signal in ("entropy", "accept"):
        with pytest.raises(ValueError, match="not simulated for MTPC"):
            rollout([mtpc], TREES, 2, Schedule("hyst", [0, 1], [0.5, 0.5], signal=signal, alpha=0.5))
    with pytest.raises(ValueError, match="calibrate again"):
        rollout([heads_cal(4)], TREES, 2, Schedule("hyst", [0, 1], [0.5, 0.5], signal="entropy", alpha=0.5))


def _quantiles(values: list[float]) -> list[float]:
    values = sorted(values)
    return [values[int(0.35 * (len(values) - 1))], values[int(0.65 * (len(values) - 1))]]


def _thresholds(cals, signal: str) -> list[float]:
    """(tau_off, tau_on) inside the range the signal takes on these calibrations."""
    if signal in ("path", "path_sum"):
        return _quantiles([path_value(c, j, 2, signal=signal) for c in cals for j in range(c.n)])
    if signal == "entropy":
        return _quantiles([math.exp(-h) for c in cals for h in c.target_entropy.tolist()])
    return [1.5, 1.8]  # accept: chain1 adds 1 or 2 tokens a step, the 2-deep tree up to 3


@pytest.mark.parametrize("signal,device_path", [("path_sum", False), ("path_sum", True), ("entropy", False),
                                                ("entropy", True), ("accept", True)])
def test_each_signal_decodes_as_ar_and_switches_as_simulated(small, tmp_path, signal, device_path):
    head = close_head(small)
    cals, wants = [], []
    for prompt in PROMPTS:
        want = decode(Target(small), Drafter(), prompt, 20).tokens
        wants.append(want)
        cals.append(calibrate(head, prompt + want, len(prompt), "t", False, max_rank=4))
    trees = [Topology("chain1"), Topology(BRANCHY)]
    schedule = {"kind": "hyst", "trees": [0, 1], "thresholds": _thresholds(cals, signal), "signal": signal,
                **({"alpha": 0.5} if signal != "path_sum" else {})}
    log = tmp_path / "steps.jsonl"
    drafter = GatedLoRADrafter(GatedLoRADraftConfig(tree=_bank(tmp_path, trees, {"hyst": schedule}), schedule="hyst",
                                                    sampler=False, log=str(log)), model=head)
    target = Target(*drafter.adapt(None, {}))
    target.cpu_paths = not device_path
    calls, accepted = decode_equal_to_ar(target, drafter, PROMPTS, wants)
    assert accepted[0] > 10 and accepted[1] > 3, accepted
    used = [json.loads(line)["tree"] for line in log.read_text().splitlines()]
    assert {0, 1} <= set(used), "the schedule never switched: nothing tested"
    sim = rollout(cals, trees, 2, Schedule(**schedule))
    assert sim.steps == calls
    assert [u for u in sim.trees_used if u is not None] == [u for u in used if u is not None]


def test_no_signal_reads_more_than_the_path_value(small, tmp_path):
    """On the device path (what a GPU runs), each signal's greedy steps make at most the reads the
    path value's make: the acceptance read, the tree's candidates and one read of the signal
    (accept none: its accept lengths are host data)."""
    head = close_head(small)
    trees = [Topology("chain1"), Topology(BRANCHY)]
    most = {}
    for signal in ("path", "path_sum", "entropy", "accept", "ema"):
        schedule = {"kind": "hyst", "trees": [0, 1], "thresholds": [0.3, 0.5], "signal": signal,
                    **({"alpha": 0.5} if signal in ("entropy", "accept", "ema") else {})}
        if signal == "accept":
            schedule["thresholds"] = [1.5, 1.8]
        drafter = GatedLoRADrafter(GatedLoRADraftConfig(tree=_bank(tmp_path, trees, {"hyst": schedule}),
                                                        schedule="hyst", sampler=False), model=head)
        target = Target(*drafter.adapt(None, {}))
        target.cpu_paths = False
        with counting_reads(drafter, target) as steps:
            decode(target, drafter, PROMPTS[0], 30)
        most[signal] = max(steps[1:])  # after the prefill
    assert most["path"] == 3, most  # acceptance + candidates + the path value
    assert all(most[s] <= most["path"] for s in most), most
    assert most["accept"] == most["path"] - 1, most


def test_appendix_b_biased_and_self_rollout_tau():
    """On a hand-built calibration: chain2's one-step score on chain1's trajectory (anchors 0, 2,
    4, where both depths are top-1) is 3.0; on its own rollout it is rejected at anchor 3 (anchors
    0, 3, 4: 2, 0, 2 drafts), 1 + 4/3. Growth's score is the same number, and the bank's report
    carries both."""
    cal = heads_cal(6, ranks={1: [0, MISS], 3: [MISS, 0]})
    chain1, chain2 = Topology("chain1"), Topology("chain2")
    assert rollout([cal], [chain1], 2).anchors == [(0, 0), (0, 2), (0, 4)]
    assert biased_tau([cal], chain2, chain1.paths, 2) == 3.0
    own = rollout([cal], [chain2], 2)
    assert own.anchors == [(0, 0), (0, 3), (0, 4)] and self_tau(own.accepted) == pytest.approx(1 + 4 / 3)
    # chain1 on the empty tree's trajectory (every anchor but the last): top-1 at 0, 1, 2, 4 of 0..4
    assert biased_tau([cal], chain1, [], 2) == pytest.approx(1.8)
    grown, scores = grow([cal], k=2, max_nodes=2, max_rank=1, blocks="chain")
    assert [t.paths for t in grown] == [chain1.paths, chain2.paths] and scores == pytest.approx([1.8, 3.0])

    trees, candidates, biased = candidate_trees({"t": [cal]}, 2, [1, 2], 1, ["chain"])
    assert sorted(biased["t"].values()) == pytest.approx([1.8, 3.0])
    costs = {"prefill": 1.0, "ar": 1.0, **{f"{t.name}@0": 1.0 + 0.1 * t.num_nodes for t in trees}}
    bank, tasks = build_bank({"t": [cal]}, trees, candidates, 2, costs, False, 0.8, 4, 0.8, 0, (), ("path",), biased)
    rows = {r["nodes"]: r for r in tasks["t"]["trees"]}
    assert rows[2]["biased_tau"] == 3.0 and rows[2]["self_tau"] == pytest.approx(1 + 4 / 3, abs=1e-4)
    assert rows[1]["biased_tau"] == pytest.approx(1.8) and rows[1]["self_tau"] == 2.0
    line = appendix_b(tasks["t"]["trees"], {r["name"] for r in tasks["t"]["trees"]})
    assert "max |biased - self| 0.667" in line and "the same ranking" in line


def test_the_sweep_keeps_each_signals_best(small):
    """With every signal asked for, ladder and hyst hold each replayable signal's best in
    `by_signal` (ema only for mask drafters), and keep the fastest; each entry's speed is its
    schedule's rollout."""
    from tests.eval.test_gated_trees import close_calibrations
    from mtpkit.eval.tree_search.pricing import tokens_per_s
    cals = close_calibrations(small)
    trees = [Topology("chain1", "leaf", name="leaf1"), Topology("chain1", "chain", name="chain1")]
    costs = {"prefill": 1.0, "ar": 1.0, "none@1": 1.1, "leaf1@1": 1.2, "chain1@1": 1.4}
    every = ("path", "path_sum", "entropy", "accept", "ema")
    out = calibrate_schedules(cals, trees, [1, 0], 2, costs, 0.8, ema_alphas=(0.5,), signals=every)
    for kind in ("ladder", "hyst"):
        signals = out[kind]["by_signal"]
        assert set(signals) == set(every)
        assert out[kind]["sim_tokens_per_s"] == max(b["sim_tokens_per_s"] for b in signals.values())
        for b in signals.values():
            entry = {name: b[name] for name in ("kind", "trees", "thresholds", "signal", "alpha", "value_depth")
                     if name in b}
            sim = rollout(cals, trees, 2, Schedule(**entry))
            assert round(tokens_per_s(sim, cals, costs, trees), 2) == b["sim_tokens_per_s"]
    heads = [heads_cal(8, target_entropy=[1.0] * 8)]
    costs = {"prefill": 1.0, "ar": 1.0, "1n@0": 1.1, "2n@0": 1.2}
    out = calibrate_schedules(heads, TREES, [0, 1], 2, costs, 0.8, ema_alphas=(0.5,), signals=every)
    assert set(out["hyst"]["by_signal"]) == {"path", "path_sum", "entropy", "accept"}  # no ema for heads
