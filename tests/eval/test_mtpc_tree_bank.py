"""MTPC trees in the acceptance simulator and under run-time schedules (`eval/tree_frontier.py
--method mtpc`, `mtpc:tree=bank.json,schedule=ladder|hyst`): the rollout of a teacher-forced
calibration takes exactly the greedy decoder's steps (Algorithm 2's cycle: accepted bytes only,
the bonus kept after a rejection and its state computed by a one-byte forward), with drafts
accepted at depth 2 and off the rank-0 path; a schedule switches trees exactly as simulated; the
command writes a bank whose trees the bench decodes, outputs identical to AR."""

import importlib
import json

import pytest
import torch

from mtpkit.eval.tree_search.calibration import Calibration, calibrate_mtpc
from mtpkit.eval.tree_search.simulate import rollout, rollout_sampled
from mtpkit.models.decoding.decoder import Target, decode
from mtpkit.models.decoding.drafter import Drafter
from mtpkit.models.mtpc.drafter import MTPCDraftConfig, MTPCDrafter
from mtpkit.models.mtpc.model import MTPCConfig, MTPCModel, window_loss, window_targets
from mtpkit.models.schedules import Schedule
from mtpkit.models.trees import Topology

tf = importlib.import_module("mtpkit.eval.tree_frontier")

PROMPTS = ([5, 17, 99, 3, 8], [40, 41, 42], [200, 1, 2, 3, 4, 5])
BRANCHY = "[[0],[1],[0,0],[0,1],[1,0]]"
NEW = 30


def fit(model, data, steps):
    """`steps` Adam steps on the window loss of every (prompt, sequence) of `data`, the prompt's
    positions masked. Without draft layers the features are the frozen backbone's (under no_grad):
    computed once, not once a step."""
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=3e-2)
    batches = []
    for prompt, seq in data:
        x = torch.tensor(seq)[None]
        labels = torch.cat([x[:, 1:], torch.full((1, 1), -100)], 1)
        labels[:, : len(prompt) - 1] = -100
        targets, valid = window_targets(labels, model.cfg.n)
        batches.append((x, model.features(x)[0] if model.draft is None else None, targets[0], valid[0]))
    for _ in range(steps):
        loss = 0
        for x, features, targets, valid in batches:
            params = model.head(model.features(x)[0] if features is None else features)
            loss = loss + window_loss(params, targets, valid, torch.zeros(x.shape[1], dtype=torch.long), 1, 0.9)[0]
        opt.zero_grad()
        loss.backward()
        opt.step()


def fitted_head(backbone, target, arch, L, steps=60, noise=0.6):
    """A head fitted to the target's own greedy continuations of PROMPTS, then perturbed, so
    decoding sees full, partial and off-rank-0 acceptances and rejections."""
    torch.manual_seed(0)
    model = MTPCModel(backbone, MTPCConfig(arch=arch, n=4, r=3, lora_layers=L, lora_rank=4))
    seqs = [p + decode(target, Drafter(), p, NEW).tokens for p in PROMPTS]
    fit(model, list(zip(PROMPTS, seqs)), steps)
    with torch.no_grad():  # the circuit's weights (not the draft layers' LoRA)
        for p in model.head.parameters():
            p.add_(noise * torch.randn_like(p))
    return model.eval(), seqs


def _decode_and_calibrate(target, drafter, model, seqs):
    calls, accepted, cals = 0, [0, 0, 0], []
    for prompt, seq in zip(PROMPTS, seqs):
        got = decode(target, drafter, prompt, NEW)
        assert got.tokens == seq[len(prompt):]  # greedy: AR's output
        calls += got.target_calls
        for d, n in enumerate(got.accept_counts[:3]):
            accepted[d] += n
        cals.append(calibrate_mtpc(model, target, seq, len(prompt), "t", depth=3, max_rank=4))
    return calls, accepted, cals


@pytest.mark.parametrize("arch,L", [("ff", 0), ("btree", 0), ("btree", 1)])
def test_the_simulator_takes_the_mtpc_decoders_steps(tiny_byte, arch, L):
    backbone, _ = tiny_byte
    target = Target(backbone)
    model, seqs = fitted_head(backbone, target, arch, L)
    for tree in (BRANCHY, "chain3"):
        calls, accepted, cals = _decode_and_calibrate(target, MTPCDrafter(MTPCDraftConfig(tree=tree), model=model),
                                                      model, seqs)
        sim = rollout(cals, [Topology(tree)], k=3)
        assert (sim.steps, sim.tokens) == (calls, NEW * len(PROMPTS))
        assert accepted[1] > 5, accepted  # depth 2 accepted
        assert sim.accepted.count(0) > 0 and None in sim.trees_used  # rejections, and their state-only cycles
        if tree == BRANCHY:  # a node off the rank-0 path accepted
            assert any(L and any(cals[c].ranks[j, :L].tolist()) for (c, j), L in zip(sim.anchors, sim.accepted))


@pytest.mark.parametrize("kind,device_path,value_depth,signal", [
    ("ladder", False, 0, "path"), ("hyst", False, 0, "path"), ("hyst", True, 0, "path"), ("hyst", False, 1, "path"),
    ("ladder", True, 1, "path"), ("hyst", True, 0, "path_sum")])
def test_mtpc_schedules_switch_trees_exactly_as_simulated(tiny_byte, tmp_path, kind, device_path, value_depth,
                                                          signal):
    """The path value (the target's top-1 probability at the newest byte with a state times the
    circuit's top-1 conditionals along its top-1 chain, as deep as the deepest tree or the
    schedule's value_depth; path_sum: the chain's products summed over its depths) chooses each
    step's tree in the drafter as in the simulator, on the CPU path and on the device path."""
    backbone, _ = tiny_byte
    target = Target(backbone)
    model, seqs = fitted_head(backbone, target, "btree", 0)
    trees = [Topology("chain1"), Topology(BRANCHY)]
    thresholds = [0.3] if kind == "ladder" else [0.25, 0.35] if signal == "path" else [0.55, 0.7]
    schedule = {"kind": kind, "trees": [0, 1], "thresholds": thresholds, "value_depth": value_depth,
                "signal": signal}
    bank = tmp_path / "bank.json"
    bank.write_text(json.dumps({"trees": [t.to_json() for t in trees],
                                "schedules": {"t": {kind: {**schedule, "sim_tau": 1.5}}}}))
    log = tmp_path / "steps.jsonl"
    drafter = MTPCDrafter(MTPCDraftConfig(tree=str(bank), schedule=kind, log=str(log)), model=model)
    target.cpu_paths = not device_path
    calls, _, cals = _decode_and_calibrate(target, drafter, model, seqs)
    used = [json.loads(line)["tree"] for line in log.read_text().splitlines()]
    assert {0, 1} <= set(used), f"the schedule never switched: nothing tested ({used})"
    sim = rollout(cals, trees, 3, Schedule(**schedule))
    assert sim.steps == calls
    assert [u for u in sim.trees_used if u is not None] == [u for u in used if u is not None]
    assert len(used) == calls  # a line per step: the prompts' forwards and the state-only cycles log None


def test_tree_frontier_for_mtpc_and_bench_end_to_end(tmp_path):
    from mtpkit.eval import bench
    from mtpkit.models.backbone import load_backbone
    from mtpkit.models.mtpc import save_head

    base, _ = load_backbone("tiny-byte-llama-random")
    torch.manual_seed(0)
    save_head(MTPCModel(base, MTPCConfig(arch="btree", n=4, r=3)), tmp_path / "head", "tiny-byte-llama-random")
    out = tmp_path / "bank.json"
    tf.main(["--backbone", "tiny-byte-llama-random", "--method", "mtpc", "--head", str(tmp_path / "head"),
             "--data", "builtin:eval", "--per-category", "3", "--holdout", "1", "--max-new-tokens", "16",
             "--budgets", "1,2,3", "--max-depth", "3", "--rounds", "2", "--pool-speed", "0", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["method"] == "mtpc" and saved["k"] == 3 and saved["check"]["matches_ar"]
    assert saved["check"]["max_abs_error"] == 0.0  # greedy: the rollout is the decoder's
    assert {f"{t['name']}@0" for t in saved["trees"]} <= set(saved["costs_ms"]) and "none@0" in saved["costs_ms"]
    assert {f"draft:{t['name']}@0" for t in saved["trees"]} <= set(saved["costs_ms"])  # drafting is priced
    assert "exact conditionals" in out.with_suffix(".md").read_text()
    results = tmp_path / "bench" / "results.json"
    # --pool-speed 0: every tree of a task's tau frontier joins its pool, whatever the timings
    task = next((t for t, s in saved["schedules"].items() if "ladder" in s), None)
    assert task is not None, f"no task has a pool of 2+ trees: {saved['schedules']}"
    specs = [f"mtpc:head={tmp_path / 'head'},tree={out},schedule={s},task={task}" for s in ("static", "ladder")]
    bench.main(["--backbone", "tiny-byte-llama-random", "--data", "builtin:eval", "--per-category", "1",
                "--max-new-tokens", "12", "--methods", *specs, "--out", str(results)])
    methods = json.loads(results.read_text())["methods"]
    assert all(methods[s]["matches_ar"] is True for s in specs)
    # under sampling: a bank of chains, checked by the expected steps on the decoder's own outputs
    sampled = tmp_path / "bank_t1.json"
    tf.main(["--backbone", "tiny-byte-llama-random", "--method", "mtpc", "--head", str(tmp_path / "head"),
             "--data", "builtin:eval", "--per-category", "3", "--holdout", "1", "--max-new-tokens", "16",
             "--max-depth", "3", "--rounds", "2", "--pool-speed", "0", "--temperature", "1.0", "--out", str(sampled)])
    saved = json.loads(sampled.read_text())
    assert all(len(t["paths"]) == max(len(p) for p in t["paths"]) for t in saved["trees"])  # chains only
    assert "replay_max_abs_error" in saved["check"] and "expected steps" in sampled.with_suffix(".md").read_text()
    with pytest.raises(ValueError, match="chains only"):
        rollout_sampled([Calibration("t", 3, 2, torch.zeros(2, 3, dtype=torch.long), torch.ones(2),
                                           torch.ones(2, 3), "alg2", torch.ones(2, 4), torch.ones(2, 3), 4)],
                           [Topology(BRANCHY)], Schedule("static", [0]), 1, 0)
    with pytest.raises(ValueError, match="signal=ema"):
        rollout([Calibration("t", 3, 2, torch.zeros(2, 3, dtype=torch.long), torch.ones(2),
                                   torch.ones(2, 3), "alg2")], [Topology("chain1"), Topology("chain2")], 3,
                   Schedule("hyst", [0, 1], [0.2, 0.3], signal="ema", alpha=0.5))


def fitted_to_samples(backbone, target, temperature, draws=8, steps=40):
    """A BTree head fitted to the target's own samples at `temperature`: its conditionals q are
    near p in places and far in others, so acceptance probabilities between 0 and 1 are common."""
    torch.manual_seed(0)
    model = MTPCModel(backbone, MTPCConfig(arch="btree", n=4, r=3))
    data = [(p, p + decode(target, Drafter(), p, NEW, temperature=temperature,
                           generator=torch.Generator().manual_seed(100 + s)).tokens) for p in PROMPTS for s in range(draws)]
    fit(model, data, steps)
    return model.eval()


def test_under_sampling_the_simulator_expects_the_mtpc_decoders_steps(tiny_byte):
    """Speculative sampling with a 3-byte MTPC chain (Algorithm 2 made exact: a full chain drops
    its bonus, a rejection keeps it and conditions the next window on it): on each of 60 decoded
    outputs, the simulator's expected steps given that output (acceptance min(p(y), q(y)) / p(y)
    per byte, 64 replicas) match the decoder's steps: their summed difference is within 4 of its
    own standard errors. Planted, a window offset after a kept bonus (accept[j][L] for
    accept[j][m + L]) fails it (z = 7.4), and so does accepting with q(y) instead (|z| = 6.1)."""
    temperature = 0.7  # T != 1 (T = 1 takes the same path without the scaling)
    backbone, _ = tiny_byte
    target = Target(backbone)
    model = fitted_to_samples(backbone, target, temperature)
    drafter = MTPCDrafter(MTPCDraftConfig(tree="chain3"), model=model)
    calls, expected, squares, accepted = 0, 0.0, 0.0, [0, 0, 0]
    for seed in range(20):
        for prompt in PROMPTS:
            got = decode(target, drafter, prompt, NEW, temperature=temperature,
                         generator=torch.Generator().manual_seed(seed))
            for d, n in enumerate(got.accept_counts[:3]):
                accepted[d] += n
            cal = calibrate_mtpc(model, target, prompt + got.tokens, len(prompt), "t", depth=3, max_rank=4,
                                    temperature=temperature)
            sim = rollout([cal], [Topology("chain3")], 3, replicas=64)
            assert sim.tokens == NEW * sim.replicas
            e = sim.steps / sim.replicas
            calls, expected, squares = calls + got.target_calls, expected + e, squares + (got.target_calls - e) ** 2
    assert accepted[1] > 20 and accepted[2] > 5, accepted  # chains accepted 2 and 3 deep
    z = (calls - expected) / squares ** 0.5
    assert abs(z) < 4, (calls, expected, z)
