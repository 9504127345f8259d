"""Fixtures of the recipe tests."""

import json

import pytest


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Chat records written here (short made-up questions and answers)."""
    out = tmp_path_factory.mktemp("data") / "chat.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"Add {i} and {i + 1}."},
                          {"role": "assistant", "content": f"{i} + {i + 1} = {2 * i + 1}. Done."}]} for i in range(24)]
    out.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return out
