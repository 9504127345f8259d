"""The package direction: train -> {models, data, eval}, eval -> {models, data}, data -> {models},
models -> none of them. Every import in every module (function-level ones included) is parsed."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = {"models": set(), "data": {"models"}, "eval": {"models", "data"}, "train": {"models", "data", "eval"}}


def imported_packages(source: str) -> list[tuple[int, str]]:
    """(line, mtpkit sub-package) of every `import mtpkit.X...` / `from mtpkit.X... import` in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] if node.module != "mtpkit" else [f"mtpkit.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "mtpkit" and len(parts) > 1:
                found.append((node.lineno, parts[1]))
    return found


def violations(package: str, files) -> list[str]:
    bad = []
    for path in files:
        for line, target in imported_packages(path.read_text()):
            if target != package and target not in ALLOWED[package]:
                bad.append(f"{path}:{line}: {package} imports mtpkit.{target}")
    return bad


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_follow_the_package_direction(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files
    assert violations(package, files) == []


def test_the_check_sees_a_wrong_import(tmp_path):
    bad = tmp_path / "wrong.py"
    bad.write_text("import torch\n\ndef f():\n    from mtpkit.train.engine import x\n    import mtpkit.eval.bench\n")
    ok = tmp_path / "ok.py"
    ok.write_text("from mtpkit.models.decoding.drafter import Drafter\nfrom mtpkit import models\n")
    assert len(violations("models", [bad])) == 2
    assert len(violations("data", [bad])) == 2
    assert violations("data", [ok]) == []
    assert violations("models", [ok]) == []
