"""Every command-line script ends through `run_script(main)`, which freezes the garbage collector's
objects before the interpreter exits (each worker of a launcher would otherwise spend over a
second in cyclic collections over the objects torch's and transformers' imports created). The one
exception, the torchrun shim, is checked not to load torch."""

import ast
import gc
import subprocess
import sys
from pathlib import Path

import pytest

from mtpkit.models.process import run_script

ROOT = Path(__file__).resolve().parents[1]
NO_TORCH = {"train/torchrun_args.py": "mtpkit.train.torchrun_args"}  # loaded by torchrun's .pth hook: stays light


def main_block(tree: ast.Module) -> ast.If | None:
    """The module's `if __name__ == "__main__":` block."""
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and \
                getattr(node.test.left, "id", None) == "__name__":
            return node
    return None


def exits_through_run_script(block: ast.If) -> bool:
    return any(isinstance(n, ast.Expr) and isinstance(n.value, ast.Call) and getattr(n.value.func, "id", None) ==
               "run_script" and [getattr(a, "id", None) for a in n.value.args] == ["main"] for n in block.body)


def scripts() -> dict[str, ast.If]:
    found = {}
    for folder in ("data", "eval", "train"):
        for path in sorted((ROOT / folder).glob("*.py")):
            block = main_block(ast.parse(path.read_text()))
            if block is not None:
                found[str(path.relative_to(ROOT))] = block
    return found


def test_every_script_exits_through_run_script():
    found = scripts()
    assert {"train/gated_lora.py", "train/mtpc.py", "train/export.py", "data/distill.py", "eval/bench.py",
            "eval/tables.py"} <= set(found)
    assert sorted(p for p, block in found.items() if not exits_through_run_script(block)) == sorted(NO_TORCH)


def test_the_exempt_script_does_not_load_torch():
    for module in NO_TORCH.values():
        out = subprocess.run([sys.executable, "-c", f"import sys, {module}; print('torch' in sys.modules)"],
                             capture_output=True, text=True, cwd=ROOT)
        assert out.stdout.strip() == "False", out.stderr[-2000:]


def test_the_check_sees_a_script_that_calls_main_directly():
    plain = ast.parse('def main():\n    pass\n\nif __name__ == "__main__":\n    main()\n')
    wrapped = ast.parse('if __name__ == "__main__":\n    run_script(main, exit_status=True)\n')
    assert not exits_through_run_script(main_block(plain))
    assert exits_through_run_script(main_block(wrapped))


def test_run_script_runs_main_then_freezes_the_collector():
    gc.unfreeze()
    seen = []
    try:
        run_script(lambda: seen.append(gc.get_freeze_count()))
        assert seen == [0] and gc.get_freeze_count() > 0
        gc.unfreeze()
        with pytest.raises(SystemExit) as e:  # exit_status: main's return value is the status
            run_script(lambda: 3, exit_status=True)
        assert e.value.code == 3 and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
    with pytest.raises(ValueError):  # a failing main propagates and freezes nothing
        run_script(lambda: (_ for _ in ()).throw(ValueError("bad flag")))
    assert gc.get_freeze_count() == 0
