"""Medusa and Hydra drafts through the one decoder (models/medusa/drafter.py): greedy output equals
AR's with drafts really accepted (tau > 1), on chains and trees, on the CPU path and the device
path (draft tokens a device tensor, acceptance on the device); a tree's tokens are the heads' top-k
as each arch defines them; speculative sampling follows the target's distribution (chi-square on
the joint of the first 3 tokens at T = 1.0 and 0.7). A bank's run-time ladder (EntMTP's schedules)
decodes as AR, switches trees exactly as the simulator predicts, and reads its signal with the
decoder's one acceptance read on the device path.

The target is tests/eval/test_gated_sampling.py's 5-token `small`; the heads are fitted here to its
own greedy continuations (the method's self-distilled data in miniature) through the training
rows and losses train/medusa.py uses, so drafts are accepted at depths 1 and 2. `hydra++` is Hydra
with the prefix-attention layer (its own KV cache of the accepted tokens while decoding)."""

import json
import math
from pathlib import Path

import pytest
import torch

from decoding_checks import decode_equal_to_ar
from chisquare import chi2_pvalue
from mtpkit.eval.tree_search.calibration import calibrate_heads
from mtpkit.eval.tree_search.simulate import path_value, rollout
from mtpkit.models.decoding.decoder import Target, decode
from mtpkit.models.decoding.drafter import Drafter
from mtpkit.models.decoding.host_reads import counting_reads
from mtpkit.models.medusa import MedusaConfig, MedusaDraftConfig, MedusaDrafter, MedusaHeads, anchor_rows, collate_rows
from mtpkit.models.medusa.model import IGNORE
from mtpkit.models.schedules import Schedule
from mtpkit.models.trees import Topology
from tests.eval.test_gated_sampling import PROMPT, VOCAB, exact_joint, sampled_joint, small  # noqa: F401

BRANCHY = "[[0],[1],[0,0],[0,1],[1,0]]"
PROMPTS = [PROMPT, [1, 2], [4, 0, 2, 2], [3], [2, 4, 1, 0, 0]]
ARCHS = ("medusa", "hydra")
VARIANTS = {"medusa": MedusaConfig(arch="medusa", heads=3, layers=2),
            "hydra": MedusaConfig(arch="hydra", heads=3, layers=2),
            "hydra++": MedusaConfig(arch="hydra", heads=3, layers=2, prefix_layer=True)}


@pytest.fixture(scope="module")
def fitted(small):
    """{variant: 3 heads fitted to the target's greedy continuations of 60 random prompts}."""
    g = torch.Generator().manual_seed(0)
    target, parts = Target(small), []
    for _ in range(60):
        prompt = torch.randint(0, VOCAB, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g).tolist()
        ids = torch.tensor(prompt + decode(target, Drafter(), prompt, 16).tokens)
        labels = ids.clone()
        labels[: len(prompt)] = IGNORE
        with torch.no_grad():
            hidden = small.get_decoder()(input_ids=ids[None]).last_hidden_state[0]
        parts.append(anchor_rows(hidden, ids, labels, 3))
    batch = collate_rows(parts, sequences=True)
    out = {}
    for name, config in VARIANTS.items():
        torch.manual_seed(0)
        heads = MedusaHeads(small, config)
        opt = torch.optim.Adam(heads.parameters(), lr=1e-2)
        for _ in range(150):
            opt.zero_grad()
            heads(**batch)["loss"].backward()
            opt.step()
        out[name] = heads.eval()
    return out


@pytest.fixture(scope="module")
def ar_outputs(small):
    target = Target(small)
    return [decode(target, Drafter(), prompt, 20).tokens for prompt in PROMPTS]


@pytest.mark.parametrize("arch,tree,path", [(arch, tree, "cpu") for arch in VARIANTS for tree in ("", BRANCHY)]
                         + [(arch, "chain2", "device") for arch in VARIANTS]
                         + [(arch, BRANCHY, path) for arch in VARIANTS for path in ("device", "static")])
def test_greedy_equals_ar_with_drafts_accepted(small, fitted, ar_outputs, arch, tree, path):
    """`device`: the GPU's path on this CPU (every row's argmax read once, acceptance on the device);
    `static`: fixed-shape steps on a static slab (mtpkit.models.decoding.step)."""
    drafter = MedusaDrafter(MedusaDraftConfig(tree=tree), model=fitted[arch])
    target = Target(small, step="static" if path == "static" else "eager", max_len=128)
    target.cpu_paths = path == "cpu"
    tokens = calls = 0
    accepted = [0, 0]
    for prompt, want in zip(PROMPTS, ar_outputs):
        got = decode(target, drafter, prompt, 20)
        assert got.tokens == want
        tokens, calls = tokens + len(got.tokens), calls + got.target_calls
        for d, n in enumerate(got.accept_counts[:2]):
            accepted[d] += n
    assert tokens / calls > 1.5 and accepted[1] > 5, (tokens / calls, accepted)


@pytest.mark.parametrize("arch", ARCHS)
@torch.no_grad()
def test_tree_tokens_are_the_heads_top_k(small, fitted, arch):
    """BRANCHY's nodes (0,) (1,) (0,0) (0,1) (1,0), as a device tensor: Medusa's depth-2 nodes are
    head 2's top tokens whatever the parent ((1,0) = (0,0)); Hydra's are head 2's top tokens on
    each parent's path, the bonus first."""
    heads = fitted[arch]
    drafter = MedusaDrafter(MedusaDraftConfig(tree=BRANCHY), model=heads)
    target = Target(small)
    drafts, observe = [], drafter.observe
    drafter.observe = lambda step: (observe(step), drafts.append((step, drafter.propose([]))))
    decode(target, drafter, PROMPT, 6)
    for step, draft in drafts:
        assert isinstance(draft.tokens, torch.Tensor) and list(draft.parents) == [0, 0, 1, 1, 2]
        h, bonus = step.hidden[step.last_node][None], step.new_tokens[-1]
        lm_head = small.get_output_embeddings()
        if arch == "medusa":
            top1 = lm_head(heads.hidden(0, h)).topk(2).indices[0].tolist()
            top2 = lm_head(heads.hidden(1, h)).topk(2).indices[0].tolist()
            want = [top1[0], top1[1], top2[0], top2[1], top2[0]]
        else:
            top1 = lm_head(heads.hidden(0, h, torch.tensor([[bonus]]))).topk(2).indices[0].tolist()
            under = [lm_head(heads.hidden(1, h, torch.tensor([[bonus, t]]))).topk(2).indices[0].tolist() for t in top1]
            want = [top1[0], top1[1], under[0][0], under[0][1], under[1][0]]
        assert draft.tokens.tolist() == want


@pytest.mark.parametrize("arch,tree,temperature", [("medusa", "chain2", 1.0), ("medusa", BRANCHY, 0.7),
                                                  ("hydra", "chain2", 0.7), ("hydra", BRANCHY, 1.0)])
def test_sampling_is_exact(small, fitted, arch, tree, temperature):
    """The first 3 tokens follow the target's joint, with drafts (one-hot top-k candidates)
    accepted at depths 1 and 2."""
    drafter = MedusaDrafter(MedusaDraftConfig(tree=tree), model=fitted[arch])
    counts, accepted = sampled_joint(Target(small), drafter, 1000, temperature, 1.0)
    assert accepted[0] > 200 and accepted[1] > 50, accepted
    assert chi2_pvalue(counts, exact_joint(small, temperature, 1.0)) > 1e-3, \
        f"speculative sampling with {arch} drafts is not distributed as the target"


def test_ranks_past_the_vocabulary_are_refused(small, fitted):
    with pytest.raises(ValueError, match="a rank of 9 needs 10 candidate tokens"):
        MedusaDrafter(MedusaDraftConfig(tree="[[9]]"), model=fitted["medusa"])


@pytest.mark.parametrize("arch,tree", [("medusa", "chain3"), ("hydra", BRANCHY),
                                       ("medusa", "[[0],[1],[2],[0,0],[1,0],[0,0,0],[0,1,0]]"),
                                       ("hydra++", "[[0],[1],[2],[0,0],[1,0],[0,0,0],[0,1,0]]")])
def test_the_simulator_takes_the_decoders_steps(small, fitted, ar_outputs, arch, tree):
    """eval/tree_frontier.py's teacher-forced pass (`calibrate_heads`) replayed by the simulator
    takes exactly the decoder's steps: every node's state drafts the next tree."""
    target = Target(small)
    drafter = MedusaDrafter(MedusaDraftConfig(tree=tree), model=fitted[arch])
    calls, cals = 0, []
    for prompt, want in zip(PROMPTS, ar_outputs):
        calls += decode(target, drafter, prompt, 20).target_calls
        cals.append(calibrate_heads(fitted[arch], target, prompt + want, len(prompt), "t", max_rank=4))
    sim = rollout(cals, [Topology(tree)], k=3)
    assert (sim.steps, sim.tokens) == (calls, 20 * len(PROMPTS))
    assert sim.tau > 1.3


@pytest.mark.parametrize("arch", ["hydra"])
def test_frontier_and_bench_end_to_end(tmp_path, arch):
    """eval/tree_frontier.py --method medusa|hydra on the tiny backbone writes a bank whose held-out
    check decodes every tree as AR does; the bench decodes with the bank's static tree, and with a
    ladder (`schedule=ladder`) as AR does."""
    from mtpkit.eval import bench
    from mtpkit.eval import tree_frontier as tf
    from mtpkit.models.backbone import load_backbone
    from mtpkit.models.medusa import save_head

    model, _ = load_backbone("tiny-llama-random")
    heads = MedusaHeads(model, MedusaConfig(arch=arch, heads=2))
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.02 * torch.randn_like(p))
    save_head(heads, tmp_path / "head", base_model="tiny-llama-random")
    out = tmp_path / "bank.json"
    tf.main(["--backbone", "tiny-llama-random", "--method", arch, "--head", str(tmp_path / "head"), "--data",
             "builtin:eval", "--per-category", "2", "--holdout", "1", "--max-new-tokens", "8", "--budgets", "1,2",
             "--rounds", "1", "--check-trees", "2", "--linear", "stock", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["method"] == arch and saved["k"] == 2 and saved["check"]["matches_ar"]
    # the random heads' frontier is one tree: a ladder over it and chain2 written in by hand
    saved["trees"].append(Topology("chain2", name="chain2").to_json())
    saved["schedules"]["code"]["ladder"] = {"kind": "ladder", "trees": [0, len(saved["trees"]) - 1],
                                            "thresholds": [0.001], "signal": "path_sum"}
    laddered = tmp_path / "ladder.json"
    laddered.write_text(json.dumps(saved))
    results = tmp_path / "bench" / "results.json"
    spec = f"{arch}:head={tmp_path / 'head'},tree={out},task=code"
    specs = [spec, f"{arch}:head={tmp_path / 'head'},tree={laddered},task=code,schedule=ladder"]
    bench.main(["--backbone", "tiny-llama-random", "--data", "builtin:eval", "--per-category", "1",
                "--max-new-tokens", "12", "--methods", *specs, "--out", str(results), "--linear", "stock"])
    methods = json.loads(results.read_text())["methods"]
    assert all(methods[s]["matches_ar"] is True for s in specs), {s: methods[s]["matches_ar"] for s in specs}


@pytest.mark.parametrize("arch,temperature", [("hydra++", 1.0), ("medusa", 0.7)])
def test_sampling_is_exact_on_the_device_path(small, fitted, arch, temperature):
    """The same on the GPU's path (this CPU with cpu_paths off): a tree of device-tensor drafts, and
    Hydra++'s prefix layer with its own cache."""
    drafter = MedusaDrafter(MedusaDraftConfig(tree=BRANCHY), model=fitted[arch])
    target = Target(small)
    target.cpu_paths = False
    counts, accepted = sampled_joint(target, drafter, 1000, temperature, 1.0)
    assert accepted[0] > 200 and accepted[1] > 50, accepted
    assert chi2_pvalue(counts, exact_joint(small, temperature, 1.0)) > 1e-3


# Run-time tree schedules (EntMTP's ladder over a bank, "EntMTP: Accelerating LLM Inference with
# Entropy Guided Multi Token Prediction", arXiv:2606.27550): the drafter switches trees by the
# signal at the deepest accepted node, read with the decoder's one acceptance read on the device path.

LADDER = [Topology("chain1"), Topology(BRANCHY), Topology("chain3")]  # small to large, up to the 3 heads


def _signal_range(cals, signal: str) -> list[float]:
    """Two thresholds inside the range the signal takes on these calibrations (its 35% and 65%
    quantiles), so that the ladder uses more than one tree."""
    if signal in ("path", "path_sum"):
        values = [path_value(c, j, 3, signal=signal) for c in cals for j in range(c.n)]
    elif signal == "entropy":
        values = [math.exp(-h) for c in cals for h in c.target_entropy.tolist()]
    else:  # accept: 1 to 4 tokens a drafted step
        return [2.0, 2.6]
    values, out = sorted(values), []
    for q in (0.35, 0.65):  # midway across the widest gap near the quantile: no value sits on a threshold
        near = range(max(int(q * (len(values) - 1)) - 3, 0), min(int(q * (len(values) - 1)) + 4, len(values) - 1))
        i = max(near, key=lambda i: values[i + 1] - values[i])
        out.append((values[i] + values[i + 1]) / 2)
    return out


def _ladder(tmp_path, cals, signal: str, log=None) -> tuple[dict, MedusaDraftConfig]:
    schedule = {"kind": "ladder", "trees": [0, 1, 2], "thresholds": _signal_range(cals, signal), "signal": signal,
                **({"alpha": 0.5} if signal in ("entropy", "accept") else {})}
    bank = tmp_path / "bank.json"
    bank.write_text(json.dumps({"trees": [t.to_json() for t in LADDER], "schedules": {"t": {"ladder": schedule}}}))
    return schedule, MedusaDraftConfig(tree=str(bank), task="t", schedule="ladder", log=str(log or ""))


@pytest.fixture(scope="module")
def calibrations(small, fitted, ar_outputs):
    """{variant: the teacher-forced pass of eval/tree_frontier.py over PROMPTS and their AR outputs}."""
    target = Target(small)
    return {arch: [calibrate_heads(heads, target, prompt + want, len(prompt), "t", max_rank=4)
                   for prompt, want in zip(PROMPTS, ar_outputs)] for arch, heads in fitted.items()}


@pytest.mark.parametrize("arch,signal,path", [(arch, signal, path) for arch in ARCHS for signal in ("path", "path_sum")
                                              for path in ("cpu", "device")]
                         + [(arch, signal, "device") for arch in ARCHS for signal in ("entropy", "accept")]
                         + [("hydra", "path", "static"), ("hydra++", "path", "device"), ("hydra++", "path", "cpu")])
def test_a_ladder_decodes_as_ar_and_switches_as_simulated(small, fitted, ar_outputs, calibrations, tmp_path, arch,
                                                          signal, path):
    """A bank's ladder over chain1 < BRANCHY < chain3: greedy output is AR's with drafts accepted,
    the ladder uses several trees, and it takes exactly the trees and steps the simulator of
    eval/tree_frontier.py predicts from the calibration (CPU path: the signal read in `observe`;
    device and fixed-shape steps: read with the acceptance decision; Hydra++: its prefix state)."""
    log = tmp_path / "steps.jsonl"
    schedule, config = _ladder(tmp_path, calibrations[arch], signal, log)
    drafter = MedusaDrafter(config, model=fitted[arch])
    target = Target(small, step="static" if path == "static" else "eager", max_len=128)
    target.cpu_paths = path == "cpu"
    calls, accepted = decode_equal_to_ar(target, drafter, PROMPTS, ar_outputs)
    assert accepted[0] > 20 and accepted[1] > 5, accepted
    used = [json.loads(line)["tree"] for line in log.read_text().splitlines()]
    assert len(set(used) - {None}) >= 2, f"the ladder never switched: nothing tested ({used})"
    sim = rollout(calibrations[arch], LADDER, 3, Schedule(**schedule))
    assert sim.steps == calls
    assert sim.trees_used == [u for u in used if u is not None]


@pytest.mark.parametrize("arch,signal,most", [("medusa", "path", 1), ("hydra", "path_sum", 1), ("hydra", "entropy", 1),
                                              ("medusa", "accept", 1), ("hydra++", "path", 2)])
def test_a_ladder_reads_with_the_acceptance_decision(small, fitted, ar_outputs, calibrations, tmp_path, arch, signal,
                                                     most):
    """On the device path (a GPU's), a scheduled step makes the static tree's one host read: the
    signal travels in the decoder's read of the acceptance decision. Hydra++'s path values need the
    prefix layer's state, made after acceptance: one read more. Host-to-device copies stay at most
    2 a step (the bonus, the accepted path's cache index) once every tree's layout is on the
    device (copied once per tree: the prompts before the one counted)."""
    steps, result = {}, {}
    for kind in ("static", "ladder"):
        _, config = _ladder(tmp_path, calibrations[arch], signal)
        config.schedule = kind
        drafter = MedusaDrafter(config, model=fitted[arch])
        target = Target(small)
        target.cpu_paths = False
        for prompt in PROMPTS[1:]:
            decode(target, drafter, prompt, 20)
        with counting_reads(drafter, target) as steps[kind]:
            result[kind] = decode(target, drafter, PROMPTS[0], 20)
        assert result[kind].tokens == ar_outputs[0] and sum(result[kind].accept_counts) > 5
        assert max(steps[kind].uploads) <= 2, steps[kind].uploads
    assert max(steps["static"]) == 1, steps["static"]
    assert max(steps["ladder"]) == most, steps["ladder"]


def test_schedules_the_heads_cannot_run_are_refused(fitted, calibrations, tmp_path):
    with pytest.raises(ValueError, match="needs a bank"):
        MedusaDrafter(MedusaDraftConfig(tree="chain2", schedule="ladder"), model=fitted["medusa"])
    _, config = _ladder(tmp_path, calibrations["medusa"], "path")
    bank = json.loads(Path(config.tree).read_text())
    bank["schedules"]["t"]["ladder"].update(signal="ema", alpha=0.5)
    Path(config.tree).write_text(json.dumps(bank))
    with pytest.raises(ValueError, match="signal ema is for the mask-token drafters"):
        MedusaDrafter(config, model=fitted["medusa"])
    bank["trees"][2] = Topology("chain4").to_json()
    bank["schedules"]["t"]["ladder"].update(signal="path")
    Path(config.tree).write_text(json.dumps(bank))
    with pytest.raises(ValueError, match="tree 2 is 4 deep"):
        MedusaDrafter(config, model=fitted["medusa"])


@pytest.mark.parametrize("arch,signal", [("hydra", "path"), ("medusa", "entropy")])
def test_a_ladder_samples_exactly_on_the_device_path(small, fitted, calibrations, tmp_path, arch, signal):
    """Under speculative sampling on the device path the signal travels in the read of the device's
    decision (last accepted node, bonus): one host read a step, trees switched, and the first 3 tokens
    still follow the target's joint."""
    log = tmp_path / "steps.jsonl"
    _, config = _ladder(tmp_path, calibrations[arch], signal, log)
    drafter = MedusaDrafter(config, model=fitted[arch])
    target = Target(small)
    target.cpu_paths = False
    with counting_reads(drafter, target) as steps:
        counts, accepted = sampled_joint(target, drafter, 1000, 1.0, 1.0)
    assert max(steps) == 1, steps
    used = {json.loads(line)["tree"] for line in log.read_text().splitlines()}
    assert len(used - {None}) >= 2, used
    assert accepted[0] > 200 and accepted[1] > 50, accepted
    assert chi2_pvalue(counts, exact_joint(small, 1.0, 1.0)) > 1e-3
