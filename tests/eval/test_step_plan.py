"""`--step auto` on a CPU (`mtpkit.models.decoding.step_plan`): compiled steps only where this
machine measured AR's compiled step faster, and only for drafters of few step shapes."""

import pytest
import torch

from mtpkit.models.decoding import step_plan
from mtpkit.models.decoding.drafter import Drafter, StockAR
from mtpkit.models.decoding.step import resolve_step
from mtpkit.models.gated_lora.drafter import GatedLoRADraftConfig, GatedLoRADrafter
from mtpkit.models.pld import PLDConfig, PLDDrafter
from mtpkit.models.probe import ProbeConfig, ProbeDrafter
from tests.models.test_gated_lora import make_gated

CPU = torch.device("cpu")


@pytest.fixture
def plans(tmp_path, monkeypatch):
    monkeypatch.setenv("MTPKIT_KERNEL_CACHE", str(tmp_path))
    return tmp_path


def test_auto_is_eager_until_this_machine_measured_compile_faster(tiny, plans):
    model, _ = tiny
    gated = GatedLoRADrafter(GatedLoRADraftConfig(decoding="linear", k=1), model=make_gated(model, k=2, rank=4))
    drafters = {"ar": Drafter(), "ar_stock": StockAR(), "gated": gated,
                "pld": PLDDrafter(PLDConfig()), "probe": ProbeDrafter(ProbeConfig(bc=10))}
    assert step_plan.recorded(model) is None
    assert {name: resolve_step("auto", CPU, model, d) for name, d in drafters.items()} == dict.fromkeys(drafters, "eager")

    entry = step_plan.record(model, eager_ms=50.0, compiled_ms=40.0, compile_s=30.0)
    assert entry["compile"] and step_plan.plan_path(model).is_file() and str(plans) in str(step_plan.plan_path(model))
    got = {name: resolve_step("auto", CPU, model, d) for name, d in drafters.items()}
    # few shapes compile; prompt lookup's and the probe's steps change shape with their drafts
    assert got == {"ar": "compile", "ar_stock": "compile", "gated": "compile", "pld": "eager", "probe": "eager"}

    step_plan.record(model, eager_ms=50.0, compiled_ms=49.0, compile_s=30.0)  # within the 3% margin: not worth it
    assert resolve_step("auto", CPU, model, Drafter()) == "eager"


def test_explicit_modes_pass_and_cuda_captures_graphs(tiny, plans):
    model, _ = tiny
    step_plan.record(model, eager_ms=50.0, compiled_ms=40.0, compile_s=30.0)
    assert resolve_step("eager", CPU, model, Drafter()) == "eager"
    assert resolve_step("static", CPU, model, PLDDrafter(PLDConfig())) == "static"
    assert resolve_step("auto", torch.device("cuda"), model, Drafter()) == "compile_graph"  # plain AR
    assert resolve_step("auto", torch.device("cuda"), model, PLDDrafter(PLDConfig())) == "graph"
    assert resolve_step("auto", CPU) == "eager"  # no model: nothing measured to go by
