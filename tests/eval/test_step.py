"""The fixed-shape step (`mtpkit.models.decoding.step`): one step per tree shape on the static
slab, run eagerly (`static`) and under `torch.compile` here (CUDA graphs need a GPU: the
prepared GPU check runs them). Greedy decoding equals AR for every drafter with drafts accepted,
speculative sampling stays exact, and the host reads per step stay within the device path's
bounds."""

import copy

import pytest
import torch

from chisquare import chi2_pvalue
from mtpkit.models.decoding.decoder import Target, decode
from mtpkit.models.decoding.drafter import Drafter
from mtpkit.models.decoding import step
from mtpkit.models.decoding.step import STEPS
from mtpkit.models.gated_lora.drafter import GatedLoRADraftConfig
from mtpkit.models.packed_linear import pack_linears
from mtpkit.models.pld import PLDConfig, PLDDrafter
from mtpkit.models.probe import ProbeConfig, ProbeDrafter
from tests.eval.test_decoder import (NEW_TOKENS, Q, SampledChainDrafter, SampledTreeDrafter, _exact_joint,
                                     _two_token_counts, _check_step_outputs, _decode_with_oracle,
                                     small_vocab_model)  # noqa: F401
from tests.eval.test_gated_decoding import OracleGated
from tests.eval.test_host_syncs import BOUNDS, UPLOADS, OracleProbe, reads_per_step
from tests.eval.test_mtpc_decoding import OracleMTPC, make_head
from tests.models.test_gated_lora import make_gated

PROMPT = list(range(10, 30))


@pytest.fixture(scope="module")
def static_case(tiny):
    """(static target, eager target, AR reference on PROMPT)."""
    model, _ = tiny
    eager = Target(model)
    return Target(model, step="static"), eager, decode(eager, Drafter(), PROMPT, 40).tokens


DRAFTERS = {
    "ar": Drafter,
    "pld": lambda: PLDDrafter(PLDConfig(draft_len=4, ngram_max=2)),
    "probe-bc10": lambda: ProbeDrafter(ProbeConfig(bc=10)),
    "probe-tree": lambda: ProbeDrafter(ProbeConfig(bc=30, masks=2, tree="7-2")),
}


@pytest.mark.parametrize("name", DRAFTERS)
def test_static_steps_equal_ar_and_the_eager_decoder(static_case, name):
    static, eager, truth = static_case
    got = decode(static, DRAFTERS[name](), PROMPT, 40)
    assert got.tokens == truth == decode(eager, DRAFTERS[name](), PROMPT, 40).tokens


def test_static_trees_with_accepted_drafts_equal_ar(static_case):
    """The probe's real trees, peaked on the AR continuation, so long paths are accepted on the
    device; the steps of the tree shapes are made once each."""
    static, _, truth = static_case
    got = decode(static, OracleProbe(truth, ProbeConfig(bc=30, masks=2)), PROMPT, 40)
    assert got.tokens == truth and sum(got.accept_counts) > 5 and len(got.accept_counts) >= 2
    assert 1 < len(static.steps.steps) < got.target_calls  # shapes recur: their steps are reused


@pytest.mark.parametrize("seed", [0, 1])
def test_static_oracle_trees_with_extra_nodes_equal_ar(tiny, seed):
    """Random trees with wrong siblings, wrong subtrees and extra nodes, rejected at random depths."""
    model, tokenizer = tiny
    case = (Target(model, step="static"), tokenizer, *_oracle_prompts(tiny))
    ids, ref, oracle, result = _decode_with_oracle(case, seed)
    assert result.tokens == ref and result.tau > 1.5
    _check_step_outputs(oracle)  # the device's acceptance: exactly the correct prefix, a path


def _oracle_prompts(tiny):
    from mtpkit.data.chat import prompt_ids
    from tests.eval.test_decoder import USER_TEXTS, _greedy_reference
    model, tokenizer = tiny
    prompts = [prompt_ids(tokenizer, [{"role": "user", "content": text}]) for text in USER_TEXTS]
    return prompts, [_greedy_reference(model, tokenizer, ids, NEW_TOKENS) for ids in prompts]


@pytest.mark.parametrize("decoding", ["linear", "quadratic"])
def test_static_gated_lora_equals_ar(tiny, decoding):
    """The gate's suffix (the mask tokens' rows) inside a fixed step: equal to AR, drafts accepted."""
    model, _ = tiny
    gated = make_gated(model, k=3, rank=4, seed=5)
    truth = decode(Target(model), Drafter(), PROMPT, 40).tokens
    oracle = OracleGated(truth, GatedLoRADraftConfig(decoding=decoding, sampler=False), gated, seed=1)
    target = Target(*oracle.adapt(None, {}), step="static")
    got = decode(target, oracle, PROMPT, 40)
    assert got.tokens == truth and got.tau > 1.5


def test_static_mtpc_equals_ar(tiny_byte):
    """MTPC's shared layer's states come out of the fixed step; its dropped bonus re-feeds a root."""
    backbone, _ = tiny_byte
    head = make_head(backbone, "btree", 1)
    prompt = torch.randint(0, 256, (8,), generator=torch.Generator().manual_seed(0)).tolist()
    want = decode(Target(backbone), Drafter(), prompt, 40).tokens
    got = decode(Target(backbone, step="static"), OracleMTPC(want, head, 0), prompt, 40)
    assert got.tokens == want and got.accept_counts and len(got.accept_counts) >= 3


@pytest.mark.parametrize("temperature,drafter", [(1.0, "chain"), (0.7, "tree")])
def test_static_speculative_sampling_is_exact(small_vocab_model, temperature, drafter):  # noqa: F811
    """Sampled chains (T = 1.0) and trees (T = 0.7) verified on the fixed step's rows: the 2-token
    output follows the target's joint."""
    static = Target(small_vocab_model, step="static")
    sampled = SampledChainDrafter(Q, seed=1) if drafter == "chain" else SampledTreeDrafter(Q, fixed=3, seed=4)
    counts = _two_token_counts(static, sampled, 1000, temperature=temperature)
    assert chi2_pvalue(counts, _exact_joint(static, 1.0, temperature)) > 1e-3, f"{drafter}: not distributed as the target"


def test_static_host_reads_and_uploads_per_step(tiny):
    """AR reads once a step and uploads nothing after its first decoding step (which copies its
    shape's layout, once); the probe's accepted trees read at most its bound, uploads at most
    two a step."""
    model, _ = tiny
    target = Target(model, step="static")
    steps, result = reads_per_step(target, Drafter(), PROMPT)
    assert result.target_calls == len(steps) == 40 and max(steps) <= BOUNDS["ar"], steps
    assert steps.uploads[1] == 1 and sum(steps.uploads) == 1, steps.uploads
    truth = result.tokens
    steps, result = reads_per_step(target, OracleProbe(truth), PROMPT)
    assert result.tokens == truth and sum(result.accept_counts) > 5
    assert max(steps) <= BOUNDS["probe"], steps
    assert max(steps.uploads) <= UPLOADS, steps.uploads


def test_compiled_steps_equal_ar_and_time_their_compilation(tiny):
    """Under torch.compile (one compilation per shape, timed apart): AR and prompt lookup equal
    the eager decoder."""
    model, _ = tiny
    target = Target(model, step="compile")
    truth = decode(Target(model), Drafter(), PROMPT, 12).tokens
    assert decode(target, Drafter(), PROMPT, 12).tokens == truth
    first = target.steps.compile_seconds
    assert first > 0 and len(target.steps.steps) == 1
    assert decode(target, Drafter(), PROMPT, 12).tokens == truth
    assert target.steps.compile_seconds == first  # the second prompt reuses the compiled step


def test_compiled_gated_steps_trace_whole_and_equal_ar(tiny, monkeypatch):
    """The gate's suffix inside a compiled step (linear decoding, the README head's): each step
    shape traces as one graph (`fullgraph`:
    a graph break or a host read inside fails) and equals AR with drafts accepted. Traced by
    dynamo and functionalised, run without inductor's code generation (`aot_eager`), which the AR
    test above runs."""
    monkeypatch.setattr(step, "COMPILE", {**step.COMPILE, "backend": "aot_eager"})
    model, _ = tiny
    gated = make_gated(model, k=3, rank=4, seed=5)
    truth = decode(Target(model), Drafter(), PROMPT, 24).tokens
    oracle = OracleGated(truth, GatedLoRADraftConfig(decoding="linear", sampler=False), gated, seed=1)
    target = Target(*oracle.adapt(None, {}), step="compile")
    got = decode(target, oracle, PROMPT, 24)
    assert got.tokens == truth and got.tau > 1.5 and len(target.steps.steps) <= 3  # the first drafts' shapes, then one


def test_a_compiled_step_on_packed_layers_traces_whole(tiny, monkeypatch):
    """The packed groups (the CPU kernels `--linear auto` puts under every method) inside a compiled
    step run as torch's layers: one graph (their weight-version checks and shared sibling output
    would break it), equal to the eager decoder on the same packed target."""
    monkeypatch.setattr(step, "COMPILE", {**step.COMPILE, "backend": "aot_eager"})
    model, _ = tiny
    packed = copy.deepcopy(model)
    assert pack_linears(packed, "auto", min_numel=0) > 0
    truth = decode(Target(packed), Drafter(), PROMPT, 12).tokens
    assert decode(Target(packed, step="compile"), Drafter(), PROMPT, 12).tokens == truth


def test_bad_step_settings_are_refused_in_one_line(tiny):
    model, _ = tiny
    with pytest.raises(ValueError, match="unknown step 'fast'"):
        Target(model, step="fast")
    for graphed in ("graph", "compile_graph"):
        with pytest.raises(ValueError, match=f"step '{graphed}' captures CUDA graphs"):
            Target(model, step=graphed)
    target = Target(model, step="static", max_len=64)
    with pytest.raises(ValueError, match="do not fit the static cache's 64"):
        decode(target, Drafter(), PROMPT, 40)
    assert set(STEPS) == {"eager", "static", "graph", "compile", "compile_graph"}
