"""MTPC decoding (Algorithm 2 on the shared decoder): greedy output token-identical to AR for every
circuit with and without LoRA draft layers and for both cycles, the draft layers' incremental
state equal to a full recomputation, speculative sampling with a circuit draft distributed as
the target, and the printed Algorithm 2 (bonus always dropped after an acceptance) failing that
same test under sampling."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from chisquare import chi2_pvalue
from mtpkit.models.decoding.decoder import Target, decode
from mtpkit.models.decoding.drafter import Drafter
from mtpkit.models.mtpc import MTPCConfig, MTPCModel
from mtpkit.models.mtpc.drafter import MTPCDraftConfig, MTPCDrafter

CONFIGS = [(arch, L) for arch in ("ff", "cp", "hmm", "btree") for L in (0, 1)]


def make_head(backbone, arch, L, n=4, seed=0):
    torch.manual_seed(seed)
    model = MTPCModel(backbone, MTPCConfig(arch=arch, n=n, r=3, lora_layers=L, lora_rank=4), seed=seed)
    with torch.no_grad():  # a trained-looking head: distinct ranks, non-zero LoRA
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.add_(0.3 * torch.randn_like(p))
    return model.eval()


class OracleMTPC(MTPCDrafter):
    """The real drafter (head, draft layers, draft cache), whose proposal is replaced by the true
    continuation corrupted at a seeded random depth, so long acceptances, partial ones and
    all-rejected cycles all happen. Every time it drafts, its e_t must equal the draft features
    recomputed over the whole sequence."""

    def __init__(self, truth, model, seed, **options):
        super().__init__(MTPCDraftConfig(**options), model)
        self.truth, self.gen_oracle, self.checked = truth, torch.Generator().manual_seed(seed), 0

    def begin(self, target, prompt_ids):
        super().begin(target, prompt_ids)
        self.start = len(prompt_ids)

    def check_state(self, tokens) -> None:
        """e_t equals the draft features recomputed over the whole sequence `tokens`."""
        with torch.no_grad():
            full = self.model.features(torch.tensor([tokens]))[0, -1 - len(self.given)]  # newest byte with a state
        # incremental == recomputed, up to the rounding of another summation order (values up to
        # ~2.7 here; CPU kernels differ by up to ~1.5e-4 between the two orders)
        torch.testing.assert_close(self.e, full, atol=1e-3, rtol=1e-3)
        self.checked += 1

    def truth_after(self, tokens, length: int) -> list[int]:
        """The next `length` true tokens after `tokens` (past the end: [0]), one corrupted at a
        seeded random depth (or none)."""
        done = len(tokens) - self.start
        spec = list(self.truth[done: done + length]) or [0]
        wrong = int(torch.randint(0, 2 * len(spec) + 1, (1,), generator=self.gen_oracle))
        if wrong < len(spec):
            spec[wrong] = (spec[wrong] + 1) % 256
        return spec

    def propose(self, tokens):
        draft = super().propose(tokens)
        if self.e is None:
            return draft
        self.check_state(tokens)
        return type(draft).chain(self.truth_after(tokens, len(draft.tokens)))


@pytest.mark.parametrize("arch,L", CONFIGS)
def test_greedy_equals_ar(tiny_byte, arch, L):
    backbone, _ = tiny_byte
    head = make_head(backbone, arch, L)
    target = Target(backbone)
    for seed in range(2):
        prompt = torch.randint(0, 256, (7 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        want = decode(target, Drafter(), prompt, 40).tokens
        drafter = MTPCDrafter(MTPCDraftConfig(), model=head)
        assert decode(target, drafter, prompt, 40).tokens == want
        oracle = OracleMTPC(want, head, seed)
        got = decode(target, oracle, prompt, 40)
        assert got.tokens == want
        assert got.accept_counts and got.accept_counts[0] > 0 and len(got.accept_counts) >= 3, got.accept_counts
        assert oracle.checked > 3
        assert got.tau > 1.3


def test_bonus_policy_of_algorithm_2(tiny_byte):
    """Accepted drafts emit no bonus; an all-rejected draft emits the free token; a state step
    emits nothing; over several oracle runs all three happen."""
    backbone, _ = tiny_byte
    head = make_head(backbone, "cp", 0)
    prompt = [5, 6, 7, 8]
    want = decode(Target(backbone), Drafter(), prompt, 40).tokens
    kinds = set()
    for seed in range(6):
        oracle = OracleMTPC(want, head, seed=seed)
        steps = []
        observe = oracle.observe
        oracle.observe = lambda step, observe=observe: (steps.append(step), observe(step))
        assert decode(Target(backbone), oracle, prompt, 40).tokens == want
        for step in steps:
            if step.accepted:
                assert len(step.new_tokens) == len(step.accepted)
                kinds.add("accepted")
            else:
                assert len(step.new_tokens) in (0, 1)
                kinds.add("free token" if step.new_tokens else "state step")
    assert kinds == {"accepted", "free token", "state step"}


VOCAB, PROMPT = 5, [0, 3, 1]
# decodes per distribution test: each planted bug (the bonus drawn from the target's p, q reported
# as its normalised square, the temperature left out at T = 0.7) fails its test at p < 1e-5 with
# 500 runs, and the printed Algorithm 2 at p < 1e-8
RUNS = 500


@pytest.fixture(scope="module")
def small():
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.5, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = LlamaForCausalLM(config).eval()
    return model


def two_token_counts(target, drafter, runs, temperature=1.0):
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.long)
    for _ in range(runs):
        x1, x2 = decode(target, drafter, PROMPT, 2, temperature=temperature, generator=g).tokens
        counts[x1, x2] += 1
    return counts


def exact_two_token_joint(model, temperature=1.0):
    """p(x1, x2) = softmax(logits / T) twice, computed here (not with the decoder's target_probs,
    so a temperature bug there cannot hide in the reference)."""
    with torch.no_grad():
        probs = lambda ids: torch.softmax(model(input_ids=torch.tensor([ids])).logits[0, -1].double() / temperature, -1)  # noqa: E731
        first = probs(PROMPT)
        second = torch.stack([probs(PROMPT + [x]) for x in range(VOCAB)])
    return first[:, None] * second


@pytest.mark.parametrize("arch,L,units,verify,T", [  # each arch, unit dtype, q and T at least once
    ("hmm", 1, "float32", "marginal", 1.0), ("cp", 0, "float32", "marginal", 1.0),
    ("cirkit", 0, "float32", "marginal", 1.0), ("btree", 1, "bfloat16", "marginal", 1.0),
    ("ff", 0, "int8", "marginal", 1.0), ("btree", 0, "int8", "path", 1.0),
    ("btree", 0, "float32", "marginal", 0.7), ("cp", 0, "float32", "path", 0.7)])
def test_speculative_sampling_with_a_circuit_draft_is_exact(small, monkeypatch, arch, L, units, verify, T):
    """units=bfloat16|int8: the units are products in lower precision, and the verifier must use
    the very q each byte was drawn from. verify=path: q is the unit the draft's latent path
    selected, never the prefix marginal (which is made to fail here)."""
    head = make_head(small, arch, L, n=2, seed=4)
    target = Target(small)
    if verify == "path":
        def no_marginal(*args, **kwargs):
            raise AssertionError("verify=path computed a prefix marginal")
        monkeypatch.setattr("mtpkit.models.mtpc.decode.LazyBTree.conditional", no_marginal)
        monkeypatch.setattr("mtpkit.models.mtpc.drafter.next_log_probs_posterior", no_marginal)
    drafter = MTPCDrafter(MTPCDraftConfig(seed=1, units=units, verify=verify), model=head)
    # a q misreported as its square shows with 800 decodes on the bf16 BTree with a draft layer
    # (p = 1e-4; 7e-3 with 500), with 500 on the others
    counts = two_token_counts(target, drafter, 800 if units == "bfloat16" else RUNS, T)
    assert chi2_pvalue(counts, exact_two_token_joint(small, T)) > 1e-3
    # the drafts were really sampled from the circuit and partly accepted
    res = decode(target, drafter, PROMPT, 20, temperature=T, generator=torch.Generator().manual_seed(9))
    assert res.draft_nodes > 0 and sum(res.accept_counts) > 0


def test_the_printed_algorithm_2_is_biased_under_sampling(small, monkeypatch):
    """Dropping the bonus after every acceptance, as Algorithm 2 is printed, throws away the
    residual sample of a rejection: the same distribution test rejects it (power check)."""
    head = make_head(small, "btree", 0, n=2, seed=4)
    drafter = MTPCDrafter(MTPCDraftConfig(seed=1), model=head)
    monkeypatch.setattr(drafter, "drop_bonus", lambda accepted, proposed: accepted > 0 or proposed == 0)
    counts = two_token_counts(Target(small), drafter, RUNS)
    assert chi2_pvalue(counts, exact_two_token_joint(small)) < 1e-3


@pytest.mark.parametrize("arch", ["btree", "hmm"])
def test_drafting_the_first_bytes_of_a_window_is_exact(small, tiny_byte, arch):
    """n=2 on a window of 4: btree drafts the first 2 bytes of a full-window sample, hmm its
    2-position marginal; both keep the target distribution, and greedy stays equal to AR."""
    head = make_head(small, arch, 0, n=4, seed=4)
    drafter = MTPCDrafter(MTPCDraftConfig(seed=1, n=2), model=head)
    counts = two_token_counts(Target(small), drafter, RUNS)
    assert chi2_pvalue(counts, exact_two_token_joint(small)) > 1e-3
    res = decode(Target(small), drafter, PROMPT, 20, temperature=1.0, generator=torch.Generator().manual_seed(9))
    assert 0 < res.draft_nodes <= 2 * res.target_calls and sum(res.accept_counts) > 0  # at most 2 per cycle
    backbone, _ = tiny_byte
    head = make_head(backbone, arch, 0, n=4)
    prompt = [5, 17, 99, 3]
    want = decode(Target(backbone), Drafter(), prompt, 30).tokens
    got = decode(Target(backbone), MTPCDrafter(MTPCDraftConfig(n=2), model=head), prompt, 30)
    assert got.tokens == want and 0 < got.draft_nodes <= 2 * got.target_calls and sum(got.accept_counts) > 0


@pytest.mark.parametrize("arch,units", [("btree", "int8"), ("hmm", "bfloat16"), ("btree", "float32")])
def test_greedy_chain_drafts_read_the_head_in_the_units_precision(tiny_byte, monkeypatch, arch, units):
    """A greedy chain draft (the circuit's mode) reads every unit of the window, but in `units`'
    precision (int8: a quarter of the float32 bytes), its inner sum weights too: the head's own
    float32 forward is never run, and greedy output stays AR's, with drafts accepted."""
    backbone, _ = tiny_byte
    head = make_head(backbone, arch, 0, n=4)
    prompt = [5, 17, 99, 3]
    want = decode(Target(backbone), Drafter(), prompt, 30).tokens

    def no_forward(*args, **kwargs):
        raise AssertionError("the greedy draft ran the head's float32 forward")
    monkeypatch.setattr(type(head.head), "forward", no_forward)
    got = decode(Target(backbone), MTPCDrafter(MTPCDraftConfig(units=units), model=head), prompt, 30)
    assert got.tokens == want and got.draft_nodes > 0 and sum(got.accept_counts) > 0
    copies = head.head.__dict__.get("_decode_copies", {})
    dtype = {"int8": torch.int8, "bfloat16": torch.bfloat16}.get(units)
    assert {name for name, d in copies if d == dtype} == (set() if dtype is None else {"unembed", "inner"})


class RedoingMTPC(MTPCDrafter):
    """Its last draft redone after every step, as the bench's floor redoes it between decodes:
    every attribute must be the very object it was, and the decode the same token for token."""

    def observe(self, step):
        super().observe(step)
        before, draws = dict(self.__dict__), self.gen.get_state()
        self.redo_draft()
        assert self.__dict__.keys() == before.keys() and all(self.__dict__[k] is v for k, v in before.items())
        assert torch.equal(self.gen.get_state(), draws)


@pytest.mark.parametrize("arch,L,T,tree", [("btree", 0, 0.0, None), ("hmm", 1, 0.0, "chain4"), ("btree", 0, 1.0, None),
                                           ("cp", 1, 0.7, None), ("btree", 0, 0.7, "[[0],[1],[0,0],[1,0],[0,0,0]]")])
def test_redoing_a_draft_changes_nothing_but_does_the_heads_work(tiny_byte, monkeypatch, arch, L, T, tree):
    """`redo_draft` proposes again from the last draft's state and drops it: greedy and sampled
    decodes (T = 1.0 and 0.7: the draws' generator restored) equal the plain drafter's, while a
    draft from a state is proposed once more per step."""
    backbone, _ = tiny_byte
    head = make_head(backbone, arch, L, n=4, seed=2)
    target = Target(backbone)
    prompt = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    drafts = []
    propose = MTPCDrafter.propose

    def counted(self, tokens):
        drafts.append(self.e is not None)
        return propose(self, tokens)
    monkeypatch.setattr(MTPCDrafter, "propose", counted)
    options = {"seed": 5, **({"tree": tree} if tree else {})}
    runs = {}
    for kind in (MTPCDrafter, RedoingMTPC):
        drafts.clear()
        res = decode(target, kind(MTPCDraftConfig(**options), model=head), prompt, 40, temperature=T,
                     generator=torch.Generator().manual_seed(7))
        runs[kind] = res, sum(drafts)
    (plain, plain_drafts), (redone, redone_drafts) = runs[MTPCDrafter], runs[RedoingMTPC]
    assert redone.tokens == plain.tokens and redone.accept_counts == plain.accept_counts
    assert plain.draft_nodes > 0 and sum(plain.accept_counts) > 0
    assert redone_drafts > plain_drafts > 0
