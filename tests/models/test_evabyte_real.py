"""The real EvaByte, tiny and random, on the CPU in fp32: its own modeling code
(tests/models/evabyte_upstream/, OpenEvaByte/evabyte at 432331ad, the Triton import made optional;
see its NOTICE.md), not a look-alike.

- exact EVA (mtpkit.models.evabyte.eva) equals the real forward over 4+ windows, prefilled at once
  or piece by piece, and plain causal attention does not (the comparison has power);
- mtpkit's AR equals EvaByte's own greedy decoding on its `EvaCache`;
- MTPC chain and tree drafts (greedy) equal AR with drafts accepted in every window, stopping
  at each window's end; another drafter's draft past it is cut there by the decoder (refused
  without the cut); the kernel plan is timed on the EVA cache, at the row counts that fit a window;
- speculative sampling with an MTPC draft across a window end is distributed as the real model;
- loading a checkpoint folder with this remote code works under transformers 5.x, and each of
  mtpkit's load-time fixes is needed (the same load without it fails).
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from chisquare import chi2_pvalue
from mtpkit.models.backbone import byte_tokenizer, eos_token_ids, load_backbone
from mtpkit.models.decoding.decoder import Target, decode
from mtpkit.models.decoding.drafter import Draft, Drafter
from mtpkit.models.evabyte import load as evaload
from mtpkit.models.evabyte.eva import EvaWindowCache
from mtpkit.models.evabyte.generate import evabyte_generate
from mtpkit.models.mtpc.drafter import MTPCDraftConfig, MTPCDrafter
from tests.eval.test_mtpc_decoding import OracleMTPC, make_head
from tests.models.evabyte_upstream.configuration_evabyte import EvaByteConfig
from tests.models.evabyte_upstream.eva_cache import EvaCache
from tests.models.evabyte_upstream.modeling_evabyte import EvaByteForCausalLM

UPSTREAM = Path(__file__).parent / "evabyte_upstream"
V, HEADS = 320, 8  # EvaByte: 256 bytes + 64 specials, 8 next-byte heads

# config.json as EvaByte's Hub checkpoints write it (rope_scaling null, use_cache on, tuples, fp32
# skip-adds and logits, mixed-precision attention), at a tiny size
HUB_CONFIG = {
    "architectures": ["EvaByteForCausalLM"], "model_type": "evabyte",
    "auto_map": {"AutoConfig": "configuration_evabyte.EvaByteConfig",
                 "AutoModelForCausalLM": "modeling_evabyte.EvaByteForCausalLM"},
    "vocab_size": V, "num_pred_heads": HEADS, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 256,
    "window_size": 16, "chunk_size": 4, "num_chunks": None, "rope_theta": 10000.0, "rope_scaling": None,
    "rms_norm_eps": 1e-6, "hidden_act": "silu", "initializer_range": 0.5, "norm_add_unit_offset": False,
    "attention_class": "mha", "fp32_skip_add": True, "fp32_logits": True, "mixedp_attn": True,
    "use_cache": True, "return_dict": False, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "float32", "transformers_version": "4.47.1",
}


def tiny_config(window: int = 16, chunk: int = 4, **overrides) -> EvaByteConfig:
    """The Hub config's settings at a tiny size (2 layers of width 64), window / chunk as given."""
    settings = {k: v for k, v in HUB_CONFIG.items() if k not in ("architectures", "auto_map", "model_type",
                                                                "torch_dtype", "transformers_version")}
    return EvaByteConfig(**{**settings, "window_size": window, "chunk_size": chunk, **overrides})


def build(config: EvaByteConfig, seed: int = 0) -> EvaByteForCausalLM:
    """A seeded random EvaByte from the real code, with mtpkit's load-time fixes (as load_backbone)."""
    evaload.fix_config(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = EvaByteForCausalLM(config)
    evaload.fix_model(model)
    return model.eval()


def ids(T: int, seed: int = 0, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (1, T), generator=torch.Generator().manual_seed(seed))


def evacache_greedy(model, prompt: list[int], steps: int) -> list[int]:
    """EvaByte's own greedy decoding: prefill, then one byte at a time on its `EvaCache`."""
    cache, seq = EvaCache(), list(prompt)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([seq]), past_key_values=cache, use_cache=True,
                    position_ids=torch.arange(len(seq))[None])
        for _ in range(steps):
            seq.append(int(out.logits[0, -1].argmax()))
            out = model(input_ids=torch.tensor([[seq[-1]]]), past_key_values=cache, use_cache=True,
                        position_ids=torch.tensor([[len(seq) - 1]]))
    return seq[len(prompt):]


@pytest.fixture(scope="module")
def eva16():
    return build(tiny_config(16, 4))


# --------------------------------------------------------------------------- exact EVA

@pytest.mark.parametrize("window,chunk,T", [(16, 4, 75), (32, 8, 140)])
def test_exact_eva_equals_the_real_forward_over_four_windows(window, chunk, T):
    model = build(tiny_config(window, chunk))
    target = Target(model)
    x = ids(T)
    with torch.no_grad():
        want = model(input_ids=x).logits[0]                                   # [T, V]: the real EVA
        cache = EvaWindowCache(2, window, chunk)                             # the prompt at once,
        whole = target.lm_head(target.body(input_ids=x, past_key_values=cache).last_hidden_state[0])
        cache, parts, at, sizes = EvaWindowCache(2, window, chunk), [], 0, [1, 3, window - 1, 2, window, 5]
        while at < T:                                                        # or piece by piece
            size = min(sizes[len(parts) % len(sizes)], T - at)
            hidden = target.body(input_ids=x[:, at: at + size], past_key_values=cache).last_hidden_state[0]
            cache.compact(at + size, [])
            parts.append(target.lm_head(hidden))
            at += size
        exact = EvaWindowCache(2, 256, chunk)                                # one window: plain attention
        plain = target.lm_head(target.body(input_ids=x, past_key_values=exact).last_hidden_state[0])
    assert cache.start == (T - 1) // window * window  # the windows were summarised
    torch.testing.assert_close(whole, want, atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.cat(parts), want, atol=1e-4, rtol=0)
    torch.testing.assert_close(plain[:window], want[:window], atol=1e-4, rtol=0)  # one window: exact attention
    assert (plain[window:] - want[window:]).abs().max() > 1e-2                   # past it EVA differs


def test_ar_equals_evabytes_own_evacache_greedy(eva16):
    prompt = ids(7, seed=1)[0].tolist()
    want = evacache_greedy(eva16, prompt, 60)  # 67 positions: across the window ends at 16, 32, 48, 64
    assert len(set(want)) > 5
    got = decode(Target(eva16), Drafter(), prompt, 60)
    assert got.tokens == want
    assert evabyte_generate(eva16, prompt, 60) == want  # the bench's hf_ar on EvaByte: the same loop


def test_embeddings_without_a_cache_and_other_caches():
    """EvaByteModel.forward reads `input_ids.shape` given embeddings only: the body runs them itself;
    a cache other than the EVA one (a static slab) is refused in one line."""
    model = build(tiny_config(8, 4))
    target, x = Target(model), ids(20, seed=2)
    with torch.no_grad():
        want = model(input_ids=x).logits
        embeds = model.get_input_embeddings()(x)
        with pytest.raises(AttributeError, match="shape"):  # modeling_evabyte.py:606, `input_ids.shape`
            model.model(inputs_embeds=embeds)
        got = target.lm_head(target.body(inputs_embeds=embeds).last_hidden_state)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        with pytest.raises(TypeError, match="EVA cache"):
            target.body(input_ids=x, past_key_values=torch.nn.Module())
    with pytest.raises(TypeError, match="EVA cache"):
        decode(Target(model, step="static"), Drafter(), x[0].tolist(), 4)


# --------------------------------------------------------------------------- MTPC on the real EvaByte

class Logged:
    """Mixin: each step's (root position, draft depth, accepted depth) recorded."""

    def begin(self, target, prompt_ids):
        super().begin(target, prompt_ids)
        self.steps = []

    def propose(self, tokens):
        draft = super().propose(tokens)
        self.steps.append([len(tokens) - 1, self.draft_depth if draft.num_nodes else 0, 0])
        return draft

    def observe(self, step):
        self.steps[-1][2] = len(step.accepted)
        super().observe(step)


class LoggedOracle(Logged, OracleMTPC):
    pass


class OracleTree(Logged, MTPCDrafter):
    """The real tree drafter (its tree cut at the window end), whose nodes are relabelled from the
    true continuation: the rank-0 path holds it (corrupted at a seeded random depth in about a
    quarter of the steps), other nodes hold another byte."""

    def __init__(self, truth, model, seed, tree):
        super().__init__(MTPCDraftConfig(tree=tree), model)
        self.truth, self.gen_oracle = truth, torch.Generator().manual_seed(seed)

    def begin(self, target, prompt_ids):
        super().begin(target, prompt_ids)
        self.start = len(prompt_ids)

    def propose(self, tokens):
        draft = super().propose(tokens)
        N = draft.num_nodes
        if not N:
            return draft
        done, paths = len(tokens) - self.start, self.tree.paths[:N]
        depth = max(len(p) for p in paths)
        truth = (list(self.truth[done: done + depth]) + [0] * depth)[:depth]
        wrong = int(torch.randint(0, 4 * depth + 1, (1,), generator=self.gen_oracle))
        labels = [(truth[len(p) - 1] + (any(p) or len(p) - 1 == wrong)) % V for p in paths]
        draft.tokens = torch.tensor(labels)
        return draft


def check_windows(steps, window: int, windows: int) -> None:
    """Every step's nodes stayed in its root's window, some drafts reached a window end, and
    drafts were accepted in at least `windows` windows."""
    assert all(root % window + depth <= window - 1 for root, depth, _ in steps), steps
    assert any(depth and root % window + depth == window - 1 for root, depth, _ in steps)
    assert len({root // window for root, _, accepted in steps if accepted}) >= windows, steps


@pytest.mark.parametrize("arch,L", [("btree", 0), ("cp", 0), ("hmm", 1)])
def test_greedy_mtpc_chains_equal_ar_across_window_ends(eva16, arch, L):
    head = make_head(eva16, arch, L, n=4)
    target = Target(eva16)
    prompt = ids(7, seed=3)[0].tolist()
    want = decode(target, Drafter(), prompt, 60).tokens
    assert decode(target, MTPCDrafter(MTPCDraftConfig(), model=head), prompt, 60).tokens == want
    oracle = LoggedOracle(want, head, seed=1)
    got = decode(target, oracle, prompt, 60)
    assert got.tokens == want and oracle.checked > 3  # (OracleMTPC: e_t equals a full recomputation)
    assert got.accept_counts and got.accept_counts[0] > 0 and len(got.accept_counts) >= 3, got.accept_counts
    assert got.tau > 1.3
    check_windows(oracle.steps, 16, windows=4)


def test_greedy_mtpc_trees_equal_ar_across_window_ends(eva16):
    head = make_head(eva16, "btree", 0, n=4)
    target = Target(eva16)
    prompt = ids(9, seed=4)[0].tolist()
    want = decode(target, Drafter(), prompt, 60).tokens
    tree = "[[0],[1],[0,0],[0,1],[1,0],[0,0,0]]"
    assert decode(target, MTPCDrafter(MTPCDraftConfig(tree=tree), model=head), prompt, 60).tokens == want
    oracle = OracleTree(want, head, seed=2, tree=tree)
    got = decode(target, oracle, prompt, 60)
    assert got.tokens == want
    assert len(got.accept_counts) >= 3 and got.tau > 1.3, got.accept_counts
    check_windows(oracle.steps, 16, windows=4)


class FixedChain(Drafter):
    """Drafts the same 4 bytes after every root, heedless of the window end."""

    def propose(self, tokens):
        return Draft.chain([0, 0, 0, 0])


class FixedTree(Drafter):
    """A tree of 4 bytes (depths 1, 2, 1, 2) and 2 extra nodes (a mask block of 2 after node 2, at
    depths 3 and 4) after every root, heedless of the window end; checks that every step comes
    back in its own numbering."""

    def __init__(self):
        self.steps = 0

    def propose(self, tokens):
        return Draft(tokens=[0, 0, 7, 7], parents=[0, 1, 0, 3], extra_embeds=torch.zeros(2, 64), extra_parents=[2, 5])

    def observe(self, step):
        assert step.hidden.shape[0] == 7 and step.logits(list(range(7))).shape == (7, V)
        assert step.last_node == (step.accepted[-1] if step.accepted else 0)
        assert step.accepted in ([], [1], [1, 2], [3], [3, 4]) and step.context_len >= 1
        self.steps += 1


def test_a_draft_past_the_window_end_is_cut_there(eva16, monkeypatch):
    """The decoder cuts a draft at the window end (`fit_window`): a chain to its first nodes, a
    tree with extra nodes to those whose depth fits, and the drafter reads the step in its own
    numbering: greedy equal to AR. Planted: with the room reverted, a step past the window end is
    refused (its nodes past the end would need the summaries of a window the step itself
    completes): exact steps cannot be built there."""
    prompt = ids(7, seed=3)[0].tolist()
    target = Target(eva16)
    want = decode(target, Drafter(), prompt, 40).tokens
    tree = FixedTree()
    assert decode(target, FixedChain(), prompt, 40).tokens == want
    assert decode(target, tree, prompt, 40).tokens == want and tree.steps > 0
    head = make_head(eva16, "btree", 0, n=4)
    monkeypatch.setattr(type(head.adapter), "draft_room", lambda self, position: None)  # the cap reverted
    with pytest.raises(ValueError, match="window end"):
        decode(Target(eva16), FixedChain(), prompt, 40)
    with pytest.raises(ValueError, match="window end"):
        decode(Target(eva16), MTPCDrafter(MTPCDraftConfig(tree="[[0],[1],[0,0],[0,0,0]]"), model=head), prompt, 40)


def test_the_kernel_plan_times_steps_on_the_eva_cache():
    """--linear auto's timing (`kernel_plan.measure`) runs the decoder's body on its EVA cache; a row
    count whose step would cross the window end after the cache is not timed."""
    from mtpkit.models.kernel_plan import measure
    from mtpkit.models.packed_linear import pack_linears

    model = build(tiny_config(16, 4))
    pack_linears(model, "onednn")  # the LM head (8 x 320 rows)
    table = measure(model, rows=(1, 8, 9), reps=2, cache_len=40)  # rows at 40..: the window [32, 48) holds 8
    assert table and all(set(t) == ({1} if "padded" in name else {1, 8}) for name, t in table.items())


# the 2-byte joint over a 5-token vocabulary; the prompt spans two windows (W = 4), so every byte
# after it is computed from the first window's summaries, and a draft after it is cut to 1 byte
VOCAB, PROMPT = 5, [0, 3, 1, 4, 2, 2, 0]


@pytest.mark.parametrize("arch", ["btree"])
def test_speculative_sampling_across_a_window_end_is_exact(arch):
    model = build(tiny_config(4, 2, vocab_size=VOCAB, max_position_embeddings=64), seed=1)
    head = make_head(model, arch, 0, n=2, seed=4)
    drafter = MTPCDrafter(MTPCDraftConfig(seed=1), model=head)
    target, g = Target(model), torch.Generator().manual_seed(0)
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.long)
    for _ in range(500):
        x1, x2 = decode(target, drafter, PROMPT, 2, temperature=1.0, generator=g).tokens
        counts[x1, x2] += 1
    with torch.no_grad():  # the real forward's joint, by enumeration
        probs = lambda seq: torch.softmax(model(input_ids=torch.tensor([seq])).logits[0, -1].double(), -1)  # noqa: E731
        joint = probs(PROMPT)[:, None] * torch.stack([probs(PROMPT + [x]) for x in range(VOCAB)])
    assert chi2_pvalue(counts, joint) > 1e-3
    res = decode(target, drafter, PROMPT, 20, temperature=1.0, generator=torch.Generator().manual_seed(9))
    assert res.draft_nodes > 0 and sum(res.accept_counts) > 0


# --------------------------------------------------------------------------- loading a checkpoint

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, eva16):
    """A checkpoint folder as the Hub holds one: config.json, weights, EvaByte's code as remote code
    (the vendored files), a tokenizer (mtpkit's byte tokenizer: EvaByte's own is not vendored)."""
    folder = tmp_path_factory.mktemp("evabyte_tiny")
    for source in UPSTREAM.glob("*.py"):
        shutil.copy(source, folder / source.name)
    (folder / "config.json").write_text(json.dumps(HUB_CONFIG, indent=1))
    save_file({k: v.contiguous() for k, v in eva16.state_dict().items()}, str(folder / "model.safetensors"))
    byte_tokenizer().save_pretrained(folder)
    # transformers' Auto class adds GenerationMixin to a remote class the first time a process loads
    # it, not on later loads (the class is registered then): load once, so every test sees the same
    load_backbone(str(folder), trust_remote_code=True)
    return folder


def loaded_works(folder: Path, reference, tmp_path):
    """Load the folder through load_backbone and use it as mtpkit does; raise where it breaks."""
    model, tokenizer = load_backbone(str(folder), trust_remote_code=True)
    x = ids(40, seed=5)
    with torch.no_grad():
        out = model(input_ids=x)
        assert not isinstance(out, tuple), "forward returned a tuple"
        torch.testing.assert_close(out.logits, reference(input_ids=x).logits, atol=1e-5, rtol=0)
    assert eos_token_ids(model, tokenizer)
    model.save_pretrained(tmp_path / "saved")
    return model


def test_a_checkpoint_folder_loads_and_logs_its_fixes_once(checkpoint, eva16, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(evaload, "_logged", set())
    with caplog.at_level("WARNING", logger=evaload.__name__):
        model = loaded_works(checkpoint, eva16, tmp_path)
        first = [r.getMessage() for r in caplog.records if r.name == evaload.__name__]
        caplog.clear()
        loaded_works(checkpoint, eva16, tmp_path / "again")
        assert not [r for r in caplog.records if r.name == evaload.__name__]  # once per process
    assert len(first) == 6 and all("[mtpkit] EvaByte" in m for m in first), first
    assert any("rotary tables rebuilt" in m and "were not the computed ones" in m for m in first)
    assert type(model).__module__.startswith("transformers_modules")  # the checkpoint's own code ran
    prompt = ids(7, seed=1)[0].tolist()
    assert decode(Target(model), Drafter(), prompt, 30).tokens == evacache_greedy(eva16, prompt, 30)


@pytest.mark.parametrize("fix", [*evaload.CONFIG_FIXES, *evaload.MODEL_FIXES])
def test_each_load_time_fix_is_needed(checkpoint, eva16, tmp_path, monkeypatch, fix):
    """The same load without one fix fails (planted revert)."""
    table = evaload.CONFIG_FIXES if fix in evaload.CONFIG_FIXES else evaload.MODEL_FIXES
    monkeypatch.delitem(table, fix)
    failure = {"rope": (KeyError, "type"), "use_cache": (AssertionError, "position_ids"),
               "return_dict": (AssertionError, "tuple"), "rotary": (AssertionError, "not close"),
               "tied_weights": (AttributeError, "keys"),
               "generation_config": (AttributeError, "generation_config|eos_token_id")}
    error, match = failure[fix]
    with pytest.raises(error, match=match):
        loaded_works(checkpoint, eva16, tmp_path)
