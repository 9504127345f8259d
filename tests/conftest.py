"""Shared fixtures. Tiny random backbones are built once per session (seconds)."""

import json
from pathlib import Path

import pytest

from mtpkit.models.backbone import load_backbone

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


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
