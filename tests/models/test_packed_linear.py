"""oneDNN prepacked linears for decoding: row results independent of the row count, ties kept,
the gated adapter's next-token rows still bit-identical to the (packed) base, and every
drafter's greedy output still token for token the AR output on the same packed target."""

import copy

import pytest
import torch
from torch import nn

from mtpkit.models.decoding.decoder import Target, decode
from mtpkit.models.decoding.drafter import Drafter
from mtpkit.models.gated_lora.drafter import GatedLoRADraftConfig
from mtpkit.models.gated_lora import GatedLoRALinear, load_head, save_head, to_inference
from mtpkit.models.packed_linear import PackedGroup, pack_rows, packed_forward, PackedLinear, fuse_siblings, onednn_available, pack_linears, packable_dtypes
from mtpkit.models.kernel_plan import set_plans
from mtpkit.models.probe import ProbeConfig, ProbeDrafter
from tests.eval.test_gated_decoding import OracleGated
from tests.models.test_gated_lora import make_gated



MIXED = ("stock", "linear", "linear", "onednn")  # 1 row, 2-3 rows, 4 rows and up


def test_rows_do_not_depend_on_how_many_are_computed():
    """Row invariance is oneDNN's, and depends on the CPU and the inner dimension: on an AMD EPYC
    it holds at in_features 384 (the byte LM's width) for every pack hint from 2 up, but not at
    1280 or 4096 for any hint (rows then differ in the last bits with the row count, as torch's
    own kernels do). Checked here at 384, without a plan (oneDNN for every row count)."""
    assert onednn_available()  # the torch pinned in the Makefile ships oneDNN
    torch.manual_seed(0)
    big = nn.Linear(384, 3000)
    x_big = torch.randn(1, 9, big.in_features)
    with torch.no_grad():
        packed = PackedLinear(big)
        assert packed.group.plan is None
        one = torch.cat([packed(x_big[:, i:i + 1]) for i in range(9)], dim=1)
        for m in range(2, 10):
            assert torch.equal(packed(x_big[:, :m]), one[:, :m]), m
        assert torch.equal(packed(x_big[0, :5]), one[0, :5])  # 2D input too
        assert torch.allclose(one, big(x_big), atol=1e-4)  # the same layer, rounded in another order
    # with gradients: F.linear itself, so training through a packed model is unchanged
    assert torch.equal(packed(x_big), big(x_big))
    # an in-place weight change is seen (repacked)
    with torch.no_grad():
        big.weight.mul_(2.0)
        assert torch.allclose(packed(x_big), big(x_big), atol=1e-4)


@torch.no_grad()
def test_padded_rows_are_the_rows_of_the_product_the_weight_was_packed_for():
    """`padded`: 1-3 rows computed as the 4 rows oneDNN packed the weight for, so each row equals
    that row of the 4-row product bit for bit, at any inner width (1536 included, where on an AMD
    EPYC oneDNN's own 1-row kernel differs from its 4-row one in the last bits)."""
    torch.manual_seed(0)
    for width in (384, 1536):
        lin = nn.Linear(width, 700)
        packed = PackedLinear(lin)
        packed.group.plan = ("padded", "padded", "padded", "onednn")
        x = torch.randn(1, 4, width)
        four = packed_forward(x, pack_rows(lin.weight.detach()), lin.bias)
        assert torch.equal(packed(x), four)
        for m in (1, 2, 3):
            y = packed(x[:, :m])
            assert y.shape == (1, m, 700) and y.is_contiguous()
            assert torch.equal(y, four[:, :m]), (width, m)
        assert torch.equal(packed(x[0, :2]), four[0, :2])  # 2D input too


@torch.no_grad()
def test_a_plan_picks_the_kernel_by_row_count():
    torch.manual_seed(0)
    lin = nn.Linear(384, 3000)
    packed = PackedLinear(lin)
    packed.group.plan = ("stock", "linear", "onednn", "linear")  # 4 rows and up: linear
    x = torch.randn(1, 7, 384)
    ref = pack_rows(lin.weight.detach())
    onednn = packed_forward(x[:, :3], ref, lin.bias)
    assert torch.equal(packed(x[:, :1]), lin(x[:, :1]))  # stock: the layer itself
    assert torch.equal(packed(x[:, :2]), torch.nn.functional.linear(x[:, :2], lin.weight, lin.bias))
    assert torch.equal(packed(x[:, :3]), onednn)
    assert torch.equal(packed(x[:, :7]), torch.nn.functional.linear(x, lin.weight, lin.bias))  # beyond: the last
    with pytest.raises(ValueError, match="a kernel plan holds only"):
        packed.group.plan = ("stock", "fast")
    assert packed.group.plan == ("stock", "linear", "onednn", "linear")  # a refused plan is not kept
    # planned `stock` rows skip the group entirely (no dispatch on AR's step); other rows go through it
    calls = []
    packed.group.__class__ = type("Counting", (PackedGroup,), {"__call__": lambda g, x, m: calls.append(x.shape)
                                                               or PackedGroup.__call__(g, x, m)})
    packed.group.plan = ("stock", "stock", "onednn")
    packed(x[:, :2]), packed(x[:, :3])
    assert calls == [(1, 3, 384)]
    packed.group.plan = ("stock",)  # every row count
    packed(x)
    assert calls == [(1, 3, 384)]
    packed.group.__class__ = PackedGroup
    # the kernels differ in the last bits, so the equalities above tell them apart
    assert not torch.equal(onednn, torch.nn.functional.linear(x[:, :3], lin.weight, lin.bias))
    packed.group.plan = ("stock", "linear", "linear")
    assert torch.equal(packed(x[:, :3]), torch.nn.functional.linear(x[:, :3], lin.weight, lin.bias))
    # bf16: the same kernels (oneDNN's bf16 product on an AVX512-BF16 CPU); close to the fp32 layer.
    # A CPU without oneDNN's bf16 kernels packs no bf16 layer (they keep torch's forward)
    bf16_layer = nn.Sequential(nn.Linear(384, 3000).to(torch.bfloat16))
    assert pack_linears(bf16_layer, "onednn", min_numel=0) == (torch.bfloat16 in packable_dtypes())
    half = PackedLinear(nn.Linear(384, 3000).to(torch.bfloat16))
    xb = x.to(torch.bfloat16)
    plans = (("stock",), ("linear",), ("onednn",)) if torch.bfloat16 in packable_dtypes() else (("stock",), ("linear",))
    for plan in plans:
        half.group.plan = plan
        got = half(xb)
        assert got.dtype == torch.bfloat16
        assert torch.allclose(got.float(), half.unpacked(xb).float(), atol=2e-2, rtol=2e-2), plan
    assert not half.group.usable(x)  # an fp32 input on bf16 weights: the layer's own forward (which refuses it)


def test_pack_linears_swaps_every_linear_and_keeps_ties(tiny):
    model = copy.deepcopy(tiny[0])
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert pack_linears(model, "stock", min_numel=0) == 0
    assert pack_linears(model, "onednn") == 0  # all below MIN_PACK: per-call overhead would dominate
    assert pack_linears(model, "onednn", min_numel=0) == linears > 0
    assert not any(type(m) is nn.Linear for m in model.modules())
    if tiny[0].get_output_embeddings().weight is tiny[0].get_input_embeddings().weight:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert pack_linears(model, "onednn", min_numel=0) == 0  # idempotent
    with pytest.raises(ValueError, match="linear must be one of"):
        pack_linears(model, "fast")
    ids = torch.arange(5, 25)[None]
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, tiny[0](ids).logits, atol=1e-4)


@torch.no_grad()
def test_fused_siblings_give_the_unfused_packed_outputs(tiny):
    model = copy.deepcopy(tiny[0])
    unfused = copy.deepcopy(tiny[0])
    pack_linears(model, "onednn", min_numel=0)
    pack_linears(unfused, "onednn", min_numel=0, fuse=False)
    layers = model.config.num_hidden_layers
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert isinstance(attn.q_proj.siblings, PackedGroup) and attn.q_proj.siblings is attn.v_proj.siblings
    assert mlp.gate_proj.siblings is mlp.up_proj.siblings and mlp.down_proj.siblings is None
    assert fuse_siblings(model) == 2 * layers  # idempotent: the same groups again
    calls = []
    group = attn.q_proj.siblings
    compute = group._compute
    group._compute = lambda x, kernel: calls.append(x.shape) or compute(x, kernel)
    ids = torch.arange(5, 17)[None]
    got = model(ids).logits
    assert len(calls) == 1  # q, k and v of the layer: one product
    assert torch.equal(got, unfused(ids).logits)  # several rows: oneDNN, the same bits
    one = torch.arange(5, 6)[None]
    assert torch.equal(model(one).logits, unfused(one).logits)  # one row: oneDNN too (no plan)
    for g in {id(m.group): m.group for m in model.modules() if hasattr(m, "group")}.values():
        g.plan = ("stock",)  # each member's own layer: torch's own result, bit for bit
    assert torch.equal(model(ids).logits, tiny[0](ids).logits)
    for g in {id(m.group): m.group for m in model.modules() if hasattr(m, "group")}.values():
        g.plan = None
    with torch.enable_grad():  # training: each member's own unpacked forward
        assert torch.allclose(model(ids).logits, tiny[0](ids).logits, atol=1e-4)
    attn.k_proj.weight.mul_(2.0)  # an in-place weight change is repacked
    unfused.model.layers[0].self_attn.k_proj.weight.mul_(2.0)
    assert torch.equal(model(ids).logits, unfused(ids).logits)
    assert not torch.allclose(model(ids).logits, got)


@torch.no_grad()
def test_packed_gated_rows_stay_the_base_and_greedy_equals_ar(tiny, tmp_path):
    base = copy.deepcopy(tiny[0])
    save_head(make_gated(base, k=3, rank=4, seed=11), tmp_path, "tiny-llama-random")
    lean = to_inference(load_head(tmp_path, copy.deepcopy(base)))
    gated_body = lean.peft.get_base_model()
    pack_linears(base, "onednn", min_numel=0)
    n = pack_linears(gated_body, "onednn", min_numel=0)
    assert n > 0 and all(isinstance(m.base, PackedLinear) for m in gated_body.modules()
                         if isinstance(m, GatedLoRALinear))
    attn = gated_body.model.layers[0].self_attn
    assert attn.q_proj.siblings is attn.k_proj.siblings is not None and attn.o_proj.siblings is None
    # the sampler's LM head is the packed one too (not a reference kept from before packing)
    assert isinstance(lean.lm_head, PackedLinear) and lean.lm_head is gated_body.get_output_embeddings()
    # ungated rows of a forward with a gated suffix: bit-identical to the packed base model
    ids = torch.arange(40, 52)[None]
    gate_rows = torch.arange(12)[None] >= 9
    with lean.gate(gate_rows):
        got = gated_body(ids).logits
    want = base(ids).logits
    assert torch.equal(got[:, :9], want[:, :9])
    assert not torch.allclose(got[:, 9:], want[:, 9:], atol=1e-3)  # the adapter does act on the masks
    # the fused siblings' gated rows: the same as each gated linear on its own
    unfused = to_inference(load_head(tmp_path, copy.deepcopy(tiny[0])))
    pack_linears(unfused.peft.get_base_model(), "onednn", min_numel=0, fuse=False)
    with unfused.gate(gate_rows):
        alone = unfused.peft.get_base_model()(ids).logits
    assert torch.allclose(got, alone, atol=1e-5) and torch.equal(got[:, :9], alone[:, :9])
    # a gate that is not one suffix (scattered rows): the general path; later rows see the masks
    scattered = torch.zeros(1, 12, dtype=torch.bool)
    scattered[0, [3, 7, 10]] = True
    with lean.gate(scattered):
        got2 = gated_body(ids).logits
    with unfused.gate(scattered):
        alone2 = unfused.peft.get_base_model()(ids).logits
    assert torch.allclose(got2, alone2, atol=1e-4) and torch.equal(got2[:, :3], want[:, :3])  # rows before the first mask

    ar = Target(base)
    probe_accepted = 0
    # no plan (oneDNN for every row count), and a plan mixing all three kernels by row count, as a
    # measured plan does: AR's 1-row steps and the verification steps then run different kernels
    for plan, seed in ((None, 0), (None, 1), (MIXED, 0), (MIXED, 1)):
        set_plans(base, {"body": plan, "head": plan})
        set_plans(gated_body, {"body": plan, "head": plan})
        prompt = torch.randint(5, 400, (7,), generator=torch.Generator().manual_seed(seed)).tolist()
        want = decode(ar, Drafter(), prompt, 24).tokens
        for decoding in ("linear", "quadratic"):
            # the random head's own speculations are hardly ever accepted: the oracle replaces them
            # by the AR continuation (corrupted at a random depth), so accepted drafts are verified
            config = GatedLoRADraftConfig(decoding=decoding, sampler=False)
            for prefetch in (0, 64):  # logits row by row on demand, or every row of a step in one call
                drafter = OracleGated(want, config, lean, seed)
                got = decode(Target(*drafter.adapt(None, {}), prefetch_rows=prefetch), drafter, prompt, 24)
                assert got.tokens == want and got.draft_nodes > 0
                assert sum(got.accept_counts) > 0, "no draft accepted: verification was not exercised"
        probe = ProbeDrafter(ProbeConfig(bc=12))
        got = decode(ar, probe, prompt, 24)
        assert got.tokens == want and got.draft_nodes > 0
        probe_accepted += sum(got.accept_counts)
    assert probe_accepted > 0, "the probe's drafts were never accepted"


@torch.no_grad()
def test_off_the_cpu_groups_fuse_with_f_linear_and_no_onednn(tiny, tmp_path, monkeypatch):
    """A GPU's groups, made here on CPU tensors with `cpu_paths` answering False: `linear="auto"`
    packs every layer (`onednn` none), siblings and a gated adapter's A rows fused, each group one
    F.linear for more than one row and the layers themselves for one (no oneDNN pack, no measured
    plan); logits as the stock layers',
    gated rows as the unfused adapter's, and greedy decoding still AR's with drafts accepted."""
    monkeypatch.setattr("mtpkit.models.packed_linear.cpu_paths", lambda device: False)
    monkeypatch.setattr("mtpkit.models.kernel_plan.cpu_paths", lambda device: False)

    def no_onednn(weight):
        raise AssertionError("a oneDNN pack off the CPU")
    monkeypatch.setattr("mtpkit.models.packed_linear.pack_rows", no_onednn)
    from mtpkit.models.kernel_plan import tune

    stock = tiny[0]
    base = copy.deepcopy(stock)
    assert pack_linears(base, "onednn", min_numel=0) == 0
    linears = sum(type(m) is nn.Linear for m in base.modules())
    assert pack_linears(base, "auto", min_numel=0) == linears > 0
    attn = base.model.layers[0].self_attn
    group = attn.q_proj.siblings
    assert group is attn.v_proj.siblings and not group.onednn and group.plan == ("stock", "linear")
    for plan in (None, ("stock", "padded")):
        with pytest.raises(ValueError, match="no oneDNN kernel"):
            group.plan = plan
    assert tune(base) is None  # nothing to measure: no plan off the CPU
    calls = []
    compute = group._compute
    group._compute = lambda x, kernel: calls.append(kernel) or compute(x, kernel)
    ids = torch.arange(40, 52)[None]
    assert torch.allclose(base(ids).logits, stock(ids).logits, atol=1e-4)
    assert calls == ["linear"]  # q, k and v of the layer: one F.linear
    # one copy of the weights: each member's is a view of its rows of the stacked product's weight
    storage = group.weight.untyped_storage().data_ptr()
    assert all(m.weight.untyped_storage().data_ptr() == storage for m in (attn.q_proj, attn.k_proj, attn.v_proj))
    assert torch.equal(attn.k_proj.weight, stock.model.layers[0].self_attn.k_proj.weight)
    packs = []
    pack = group._pack
    group._pack = lambda: packs.append(1) or pack()
    base(ids)
    assert packs == []  # the views made no repack
    one = ids[:, :1]
    assert torch.equal(base(one).logits, stock(one).logits) and calls == ["linear"] * 2  # one row: the layers themselves
    group._compute = compute
    changed = copy.deepcopy(stock)
    attn.k_proj.weight.mul_(2.0)  # an in-place change of a member: the group computes with it
    changed.model.layers[0].self_attn.k_proj.weight.mul_(2.0)
    assert torch.allclose(base(ids).logits, changed(ids).logits, atol=1e-4)
    assert not torch.allclose(base(ids).logits, stock(ids).logits, atol=1e-3)
    attn.k_proj.weight.mul_(0.5)
    group._pack = pack

    save_head(make_gated(copy.deepcopy(stock), k=3, rank=4, seed=11), tmp_path, "tiny-llama-random")
    lean = to_inference(load_head(tmp_path, copy.deepcopy(stock)))
    gated_body = lean.peft.get_base_model()
    assert pack_linears(gated_body, "auto", min_numel=0) > 0
    gattn = gated_body.model.layers[0].self_attn
    assert gattn.q_proj.siblings is gattn.k_proj.siblings is not None and len(gattn.q_proj.group.lora) == 3
    unfused = to_inference(load_head(tmp_path, copy.deepcopy(stock)))  # peft's layers made lean, not packed
    gate_rows = torch.arange(12)[None] >= 9
    with lean.gate(gate_rows):
        got = gated_body(ids).logits
    with unfused.gate(gate_rows):
        alone = unfused.peft.get_base_model()(ids).logits
    assert torch.allclose(got, alone, atol=1e-5)
    assert not torch.allclose(got[:, 9:], base(ids).logits[:, 9:], atol=1e-3)  # the adapter acts on the masks

    ar = Target(base)
    prompt = torch.randint(5, 400, (7,), generator=torch.Generator().manual_seed(0)).tolist()
    want = decode(ar, Drafter(), prompt, 24).tokens
    for decoding in ("linear", "quadratic"):
        drafter = OracleGated(want, GatedLoRADraftConfig(decoding=decoding, sampler=False), lean, 0)
        target = Target(*drafter.adapt(None, {}))
        target.cpu_paths = False  # the decoder's device path, as on a GPU
        got = decode(target, drafter, prompt, 24)
        assert got.tokens == want and sum(got.accept_counts) > 0
