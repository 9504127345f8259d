"""Shared fixtures. Tiny random backbones are built once per session (seconds)."""

import json
import os
from pathlib import Path

import pytest

from mtpkit.models.backbone import load_backbone

TESTS = Path(__file__).resolve().parent
SHARED_DATA = TESTS.parents[1] / "shared" / "data"
# Modules whose tests start multi-process launches (torchrun, accelerate, DeepSpeed, the SLURM
# scripts): each launch keeps every core busy, and several take the launchers' default port 29500.
# A module that starts such launches belongs here (see pytest_xdist_make_scheduler).
LAUNCHES = {"tests/data/test_distill_sharded.py", "tests/recipes/test_gated_lora_recipe.py",
            "tests/recipes/test_literal_commands.py", "tests/recipes/test_mtpc_recipe.py",
            "tests/recipes/test_multinode.py", "tests/recipes/test_run_safety.py"}


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject.toml's addopts): the whole suite runs on pytest-xdist's workers, one
    per core (or PYTEST_XDIST_AUTO_NUM_WORKERS); a run of named files or tests runs in this
    process, where starting workers (each imports torch and transformers) costs more than it saves."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own hook reads it
    whole = all(Path(arg.split("::")[0]).resolve() == TESTS for arg in config.args)
    return None if whole else 0


def pytest_configure(config):
    """On pytest-xdist's workers (one per core), torch runs the cores' share of threads per worker,
    and so do the scripts the tests start: two workers of as many threads as cores each would
    oversubscribe the cores, and OpenMP's threads spin waiting for each other (several times the
    CPU time on the tiny models). The launch tests set OMP_NUM_THREADS=1 for their processes."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        threads = max(1, (os.cpu_count() or 1) // workers)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


def pytest_xdist_make_scheduler(config, log):
    """How the workers share the tests: a module runs whole on one worker (its module fixtures
    built once), and the modules of LAUNCHES together on one, so their launches run one after
    another as in a single process (no two on port 29500 at once, none sharing the cores with
    another launch) while the other worker runs the in-process tests."""
    from xdist.scheduler import LoadScopeScheduling

    class ModulesAndLaunches(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "launches" if module in LAUNCHES else module

    return ModulesAndLaunches(config, log)


@pytest.fixture(scope="session", autouse=True)
def kernel_cache(tmp_path_factory):
    """Kernel plans measured by the tests go to a temporary folder, not the user's cache, and time
    one step per sample (a tiny model would otherwise average ~30 steps per sample)."""
    folder = tmp_path_factory.mktemp("kernels")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MTPKIT_KERNEL_CACHE", str(folder))
        mp.setattr("mtpkit.models.kernel_plan.MIN_SAMPLE_S", 0.0)
        yield folder


@pytest.fixture(scope="session")
def tiny():
    return load_backbone("tiny-llama-random")


@pytest.fixture(scope="session")
def tiny_byte():
    return load_backbone("tiny-byte-llama-random")


@pytest.fixture(scope="session")
def smollm2():
    """The default backbone (cached safetensors; the first run builds the cache from the wheel)."""
    return load_backbone("smollm2-135m-instruct")


@pytest.fixture
def shared_data():
    if not SHARED_DATA.is_dir():
        pytest.skip(f"{SHARED_DATA} is absent (development data lives beside the checkout)")
    return SHARED_DATA


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Chat records written here (short made-up questions and answers)."""
    out = tmp_path_factory.mktemp("data") / "chat.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"Add {i} and {i + 1}."},
                          {"role": "assistant", "content": f"{i} + {i + 1} = {2 * i + 1}. Done."}]} for i in range(24)]
    out.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return out
