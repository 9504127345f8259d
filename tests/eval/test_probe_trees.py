"""Draft trees and tree schedules of the training-free probe (probe:tree=bank.json,schedule=...),
and `eval/tree_frontier.py --method probe`.

The target is tests/eval/test_gated_sampling.py's 5-token `small`: the probe's mask outputs rank
the true token high often enough that drafts are accepted at depths 1 and 2."""

import json

import pytest

from chisquare import chi2_pvalue
from mtpkit.eval import tree_frontier as tf
from mtpkit.eval.tree_search.calibration import calibrate_probe
from mtpkit.eval.tree_search.simulate import rollout
from mtpkit.models.decoding.decoder import Target, decode
from mtpkit.models.decoding.drafter import Drafter
from mtpkit.models.probe import ProbeConfig, ProbeDrafter
from mtpkit.models.schedules import Schedule
from mtpkit.models.trees import Topology
from tests.eval.test_gated_sampling import exact_joint, sampled_joint, small  # noqa: F401
from tests.eval.test_gated_trees import BRANCHY, PROMPTS, _bank


def decode_all(small, drafter, new=20):
    """Every prompt decoded greedily with `drafter` (checked against AR); target calls, accepted
    drafts at depths 1 and 2, and each prompt's teacher-forced probe calibration."""
    target = Target(small)
    calls, accepted, cals = 0, [0, 0], []
    probe = ProbeDrafter(ProbeConfig(tree="chain2", masks=2, lam=drafter.config.lam))
    for prompt in PROMPTS:
        want = decode(target, Drafter(), prompt, new).tokens
        got = decode(target, drafter, prompt, new)
        assert got.tokens == want
        calls += got.target_calls
        for d, n in enumerate(got.accept_counts[:2]):
            accepted[d] += n
        cals.append(calibrate_probe(target, probe, prompt + want, len(prompt), "t", max_rank=4))
    return calls, accepted, cals


@pytest.mark.parametrize("tree,blocks", [("chain2", "chain"), (BRANCHY, "chain"), (BRANCHY, "all")])
def test_greedy_probe_trees_equal_ar_and_the_simulator_predicts_every_step(small, tmp_path, tree, blocks):
    """With frozen masks (lam = 0) the teacher-forced calibration sees the very masks decoding
    feeds, so the simulated rollout takes exactly the decoder's steps; drafts are accepted at depth
    1 and 2."""
    drafter = ProbeDrafter(ProbeConfig(tree=_bank(tmp_path, [Topology(tree, blocks)]), masks=2, lam=0.0))
    calls, accepted, cals = decode_all(small, drafter)
    assert accepted[0] > 10 and accepted[1] > 3, accepted
    sim = rollout(cals, [Topology(tree, blocks)], k=2)
    assert (sim.steps, sim.tokens) == (calls, 20 * len(PROMPTS))


def test_with_mask_updates_the_simulator_is_close(small, tmp_path):
    """lam = 0.1 (the paper's Eq. 4): outputs still AR's; the calibration's masks run up to a
    draft's length ahead of decoding's, so the simulation is close, not exact."""
    drafter = ProbeDrafter(ProbeConfig(tree=_bank(tmp_path, [Topology(BRANCHY)]), masks=2))
    calls, accepted, cals = decode_all(small, drafter)
    assert accepted[0] > 10, accepted
    sim = rollout(cals, [Topology(BRANCHY)], k=2)
    assert abs(sim.steps / calls - 1) < 0.15, (sim.steps, calls)


@pytest.mark.parametrize("kind", ["ladder", "hyst"])
def test_probe_schedules_switch_trees_as_simulated(small, tmp_path, kind):
    trees = [Topology("chain1"), Topology(BRANCHY)]
    schedule = {"kind": kind, "trees": [0, 1], "thresholds": [0.25] if kind == "ladder" else [0.2, 0.3]}
    log = tmp_path / "steps.jsonl"
    bank = _bank(tmp_path, trees, {kind: {**schedule, "sim_tau": 1.5, "sim_tokens_per_s": 20.0}})
    drafter = ProbeDrafter(ProbeConfig(tree=bank, schedule=kind, masks=2, lam=0.0, log=str(log)))
    calls, _, cals = decode_all(small, drafter)
    used = [json.loads(line)["tree"] for line in log.read_text().splitlines()]
    assert {0, 1} <= set(used), "the schedule never switched: nothing tested"
    sim = rollout(cals, trees, 2, Schedule(**schedule))
    assert sim.steps == calls
    assert [u for u in sim.trees_used if u is not None] == [u for u in used if u is not None]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_probe_tree_sampling_is_exact(small, tmp_path, temperature):
    """Speculative sampling with a hysteresis schedule over a chain and a branching tree: the first
    3 tokens follow the target's joint, with drafts accepted at depths 1 and 2."""
    trees = [Topology("chain1"), Topology(BRANCHY)]
    entry = {"kind": "hyst", "trees": [0, 1], "thresholds": [0.1, 0.2]}
    drafter = ProbeDrafter(ProbeConfig(tree=_bank(tmp_path, trees, {"hyst": entry}), schedule="hyst", masks=2))
    counts, accepted = sampled_joint(Target(small), drafter, 1000, temperature, 1.0)
    assert accepted[0] > 200 and accepted[1] > 50, accepted
    assert chi2_pvalue(counts, exact_joint(small, temperature, 1.0)) > 1e-3


def test_bad_probe_tree_options_are_clear(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        ProbeDrafter(ProbeConfig(tree=str(tmp_path / "missing.json")))
    with pytest.raises(ValueError, match="not a JSON list of rank paths"):
        ProbeDrafter(ProbeConfig(tree="7-x"))
    with pytest.raises(ValueError, match="no calibrated 'ladder'"):
        ProbeDrafter(ProbeConfig(tree=_bank(tmp_path, [Topology("chain1")]), schedule="ladder"))


def test_probe_frontier_and_bench_end_to_end(tmp_path):
    """eval/tree_frontier.py --method probe on the tiny backbone writes a bank whose held-out check
    decodes every tree (outputs identical to AR); the bench decodes with the bank's static tree
    (ladder and hyst need two trees in a task's pool, which timings on this random model decide)."""
    from mtpkit.eval import bench

    out = tmp_path / "bank.json"
    tf.main(["--backbone", "tiny-llama-random", "--method", "probe", "--masks", "2", "--data", "builtin:eval",
             "--per-category", "3", "--holdout", "1", "--max-new-tokens", "12", "--budgets", "1,2,3",
             "--rounds", "2", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["method"] == "probe" and saved["k"] == 2 and saved["check"]["prompts"] == 4 and saved["check"]["matches_ar"]
    assert all("static" in s for s in saved["schedules"].values())
    assert {f"draft:{t['name']}@2" for t in saved["trees"]} <= set(saved["costs_ms"])  # drafting is priced
    results = tmp_path / "bench" / "results.json"
    spec = f"probe:tree={out},masks=2,schedule=static,task=code"
    bench.main(["--backbone", "tiny-llama-random", "--data", "builtin:eval", "--per-category", "1",
                "--max-new-tokens", "12", "--methods", spec, "--out", str(results), "--linear", "stock"])
    assert json.loads(results.read_text())["methods"][spec]["matches_ar"] is True


def test_tree_options_are_documented_for_every_tree_drafter():
    """The options the tree drafters (gated LoRA, the probe, MTPC, Medusa and Hydra) inherit from
    TreeOptions keep their docstrings in --help."""
    from mtpkit.eval.bench import methods_help

    text = methods_help()
    assert text.count("schedule='static': static | ladder | hyst") == 5
    assert text.count("log='': append one JSON line per verifier step") == 5
