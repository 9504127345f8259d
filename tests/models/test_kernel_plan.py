"""The per-machine kernel plan: the fastest kernel per (class, row count), noise kept from flipping
it, measured once and cached per machine / model / dtype, set on every target alike."""

import copy
import json

import pytest
import torch

from mtpkit.models import kernel_plan
from mtpkit.models.kernel_plan import choose, expand, groups_of, measure, set_plans, tune
from mtpkit.models.packed_linear import KERNELS, pack_linears


def test_expand_takes_the_lower_measured_count():
    assert expand({1: "stock", 4: "onednn", 8: "linear"}, [1, 4, 8]) == (
        "stock", "stock", "stock", "onednn", "onednn", "onednn", "onednn", "linear")


def test_choose_takes_the_fastest_pair_and_keeps_the_previous_one_within_noise():
    table = {"stock/stock": {1: 30.0, 2: 34.0, 4: 48.0, 8: 60.0},
             "stock/onednn": {1: 30.5, 2: 33.5, 4: 44.0, 8: 58.0},  # 2 rows: within 2% of stock/stock
             "onednn/onednn": {1: 40.0, 2: 41.0, 4: 45.0, 8: 55.0}}
    plans = choose(table)
    assert plans["body"] == ("stock",) * 7 + ("onednn",)
    assert plans["head"] == ("stock",) * 3 + ("onednn",) * 5
    assert choose(table, keep=0.0)["head"][1] == "onednn"  # without the margin the noise would flip it
    # at 1 row torch's own layers stay unless another pair is faster by more than 5%
    table["stock/onednn"][1] = 28.8
    assert choose(table)["head"][0] == "stock" and choose(table, stock_keep=0.0)["head"][0] == "onednn"
    table["stock/onednn"][1] = 28.4
    assert choose(table)["head"][0] == "onednn"


@pytest.fixture
def packed_tiny(tiny, monkeypatch):
    monkeypatch.setattr("mtpkit.models.packed_linear.MIN_PACK", 0)
    model = copy.deepcopy(tiny[0])
    pack_linears(model, "onednn")
    return model


@torch.no_grad()
def test_measure_times_every_kernel_pair_for_every_row_count_and_restores_the_plans(packed_tiny):
    groups = groups_of(packed_tiny)
    assert len(groups["head"]) == 1 and groups["body"]
    groups["body"][0].plan = ("linear",)
    table = measure(packed_tiny, rows=(1, 3, 4), reps=2, cache_len=8)
    # the LM head is a group of one: `linear` is `stock` there, so it is not timed twice
    assert set(table) == {f"{b}/{h}" for b in KERNELS for h in ("stock", "onednn", "padded")}
    # `padded` is `onednn` from PACK_ROWS rows up: timed below them only
    assert all(set(t) == ({1, 3} if "padded" in name else {1, 3, 4}) and min(t.values()) > 0
               for name, t in table.items())
    assert set(choose(table)) == {"body", "head"}  # a table with gaps is one choose reads
    assert groups["body"][0].plan == ("linear",) and groups["body"][1].plan is None


def test_tune_measures_once_per_machine_model_and_dtype_and_sets_every_target(packed_tiny, monkeypatch, tmp_path):
    monkeypatch.setenv("MTPKIT_KERNEL_CACHE", str(tmp_path))
    calls = []
    table = {"stock/stock": {1: 1.0, 4: 9.0}, "linear/stock": {1: 0.9, 4: 9.0}, "onednn/onednn": {1: 3.0, 4: 5.0}}
    monkeypatch.setattr(kernel_plan, "measure", lambda model, rows, *a, **k: calls.append(rows) or table)
    copy_of = copy.deepcopy(packed_tiny)  # an adapted copy of the target (gated LoRA, say)
    record = tune(packed_tiny, [copy_of], rows=(1, 4))
    assert len(calls) == 1 and not record["cached"]
    assert record["plans"] == {"body": ["linear"] * 3 + ["onednn"], "head": ["stock"] * 3 + ["onednn"]}
    for model in (packed_tiny, copy_of):
        groups = groups_of(model)
        assert all(g.plan == ("linear", "linear", "linear", "onednn") for g in groups["body"])
        assert groups["head"][0].plan == ("stock", "stock", "stock", "onednn")
    path = kernel_plan.cache_path(packed_tiny)
    saved = json.loads(path.read_text())
    assert saved["machine"]["cores"] >= 1 and saved["rows"] == [1, 4]
    # the next run on this machine reads the plan; --retune measures again
    set_plans(packed_tiny, {})
    assert tune(packed_tiny, rows=(1, 4))["cached"] and len(calls) == 1
    assert groups_of(packed_tiny)["head"][0].plan == ("stock", "stock", "stock", "onednn")
    assert not tune(packed_tiny, rows=(1, 4), retune=True)["cached"] and len(calls) == 2
    # another dtype is another model: its own plan
    half = copy.deepcopy(packed_tiny).to(torch.bfloat16)
    assert kernel_plan.cache_path(half) != path
    tune(half, rows=(1, 4))
    assert len(calls) == 3
    # a broken cache file is measured again, with a message, not trusted
    path.write_text("{not json")
    messages = []
    assert not tune(packed_tiny, rows=(1, 4), log=messages.append)["cached"] and len(calls) == 4
    assert any("unreadable kernel plan" in m for m in messages)
    path.write_text(json.dumps({"format": kernel_plan.FORMAT, "median_ms": {}, "plans": {"body": ["fast"]}}))
    assert not tune(packed_tiny, rows=(1, 4), log=messages.append)["cached"] and len(calls) == 5


def test_tune_leaves_an_unpacked_model_alone(tiny):
    assert tune(tiny[0]) is None


@pytest.fixture
def gated_copy(tiny, tmp_path, monkeypatch):
    """A packed gated-LoRA copy of the tiny backbone (the lean decoding form) and the copy's gate."""
    from mtpkit.models.gated_lora import load_head, save_head, to_inference
    from tests.models.test_gated_lora import make_gated

    monkeypatch.setattr("mtpkit.models.packed_linear.MIN_PACK", 0)
    save_head(make_gated(copy.deepcopy(tiny[0]), k=3, rank=4, seed=11), tmp_path / "head", "tiny-llama-random")
    lean = to_inference(load_head(tmp_path / "head", copy.deepcopy(tiny[0])))
    body = lean.peft.get_base_model()
    pack_linears(body, "onednn")
    return body, lean.gate


@torch.no_grad()
def test_a_gated_copy_is_timed_with_its_adapter_on(gated_copy, monkeypatch):
    body, gate = gated_copy
    assert kernel_plan.gate_of(body) is gate
    assert [kernel_plan.gated_rows(m) for m in (1, 2, 3, 4, 6, 7)] == [1, 1, 1, 2, 2, 3]
    seen = []  # (rows of the forward, gated rows) of every timed step
    head = body.get_output_embeddings()
    monkeypatch.setattr(head, "forward", lambda h, f=head.forward: seen.append(
        (h.shape[1], None if gate.rows is None else gate.rows.tolist())) or f(h))
    measure(body, rows=(1, 3, 4), reps=2, cache_len=8)
    steps = [s for s in seen if s[0] in (3, 4)]
    assert steps and all(rows == list(range(m - kernel_plan.gated_rows(m), m)) for m, rows in steps)
    assert gate.rows is None  # the gate is off again after timing


def test_tune_gives_a_gated_copy_a_plan_of_its_own(packed_tiny, gated_copy, monkeypatch, tmp_path):
    body, gate = gated_copy
    monkeypatch.setenv("MTPKIT_KERNEL_CACHE", str(tmp_path))
    plain = {"stock/stock": {1: 1.0, 4: 9.0}, "onednn/onednn": {1: 3.0, 4: 5.0}}
    gated = {"stock/stock": {1: 2.0, 4: 9.0}, "linear/stock": {1: 1.0, 4: 9.0}, "onednn/onednn": {1: 3.0, 4: 5.0}}
    timed = []
    monkeypatch.setattr(kernel_plan, "measure", lambda model, rows, *a, **k: timed.append(model) or (
        gated if kernel_plan.gate_of(model) is not None else plain))
    plain_copy = copy.deepcopy(packed_tiny)
    record = tune(packed_tiny, [plain_copy, body], rows=(1, 4))
    assert timed == [body, packed_tiny]  # the plain copy takes the model's plan, untimed
    assert kernel_plan.cache_path(body) != kernel_plan.cache_path(packed_tiny)  # the LoRA width is in the key
    assert record["plans"]["body"] == ["stock"] * 3 + ["onednn"]
    assert record["adapted"][0]["plans"]["body"] == ["linear"] * 3 + ["onednn"]
    assert all(g.plan == ("stock", "stock", "stock", "onednn") for g in groups_of(plain_copy)["body"])
    assert all(g.plan == ("linear", "linear", "linear", "onednn") for g in groups_of(body)["body"])
    # both cached: a second run times nothing
    record = tune(packed_tiny, [body], rows=(1, 4))
    assert len(timed) == 2 and record["cached"] and record["adapted"][0]["cached"]
