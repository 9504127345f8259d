"""The design's commands as typed: `torchrun train/mtpc.py --arch btree --n 16` and `accelerate launch
train/gated_lora.py` (flags appended for size), run by the environment's own `torchrun` and
`accelerate` commands on tiny backbones; and train/torchrun_args.py, the hook that lets torchrun
read its options only up to the training script (pytorch issue #120601)."""

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch.distributed.run as torchrun_module

from mtpkit.train import torchrun_args
from tests.recipes.test_gated_lora_recipe import assert_checkpoint

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
NOT_INSTALLED = (f"the torchrun hook is not installed in this environment: run `make install` or "
                 f"`{sys.executable} -m mtpkit.train.torchrun_args --install`")


def run(cmd: list[str], timeout=300) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", ACCELERATE_DISABLE_RICH="1", PYTHONPATH="")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stderr[-3000:]}"
    return proc


def test_torchrun_mtpc_btree_n16_as_written(data, tmp_path):
    assert hasattr(torchrun_module.parse_args, "__wrapped__"), NOT_INSTALLED
    out = tmp_path / "mtpc"
    run([str(BIN / "torchrun"), "train/mtpc.py", "--arch", "btree", "--n", "16",
         "--backbone", "tiny-byte-llama-random", "--data", str(data), "--max-steps", "2", "--output-dir", str(out),
         "--max-length", "64", "--windows-per-sequence", "4", "--rank", "3", "--eval-every", "0"])
    assert (out / "checkpoint-2" / "head" / "head.safetensors").is_file()
    config = (out / "checkpoint-2" / "config.yaml").read_text()
    assert "arch: btree" in config and "n: 16" in config


def test_accelerate_launch_gated_lora_as_written(data, tmp_path):
    """One process (accelerate's default here): the checkpoint's files, every step logged, and the
    evaluation's simulated tau."""
    out = tmp_path / "gated_lora"
    run([str(BIN / "accelerate"), "launch", "train/gated_lora.py",
         "--backbone", "tiny-llama-random", "--data", str(data), "--max-steps", "4", "--output-dir", str(out),
         "--k", "2", "--rank", "4", "--max-length", "128", "--log-every", "1", "--save-every", "4",
         "--eval-every", "4", "--eval-prompts", "1", "--eval-max-new-tokens", "6"])
    assert_checkpoint(out, 4)
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    assert any("sim_tau" in r and r["sim_tau"] >= 1.0 for r in rows)


def parse(argv: list[str]):
    """torch.distributed.run's parse_args with the hook, whether or not this environment has it."""
    original = getattr(torchrun_module.parse_args, "__wrapped__", torchrun_module.parse_args)
    return torchrun_args.wrap_parse_args(original, torchrun_module.get_args_parser)(argv)


@pytest.mark.parametrize("argv, launcher, script, script_args", [
    (["train/mtpc.py", "--arch", "btree", "--n", "16"], {}, "train/mtpc.py", ["--arch", "btree", "--n", "16"]),
    (["--nproc", "2", "x.py", "--n", "16"], {"nproc_per_node": "2"}, "x.py", ["--n", "16"]),
    (["--nproc_per_node=2", "--nnodes", "2", "x.py", "--nnodes=3"], {"nproc_per_node": "2", "nnodes": "2"}, "x.py",
     ["--nnodes=3"]),
    (["--standalone", "x.py", "--standalone"], {"standalone": True}, "x.py", ["--standalone"]),
    (["-m", "-r", "3", "pkg.mod", "-m", "--n=4"], {"module": True, "redirects": "3"}, "pkg.mod", ["-m", "--n=4"]),
    (["-t3", "--master-addr", "10.0.0.1", "x.py", "-n", "16", "--window", "8"],
     {"tee": "3", "master_addr": "10.0.0.1"}, "x.py", ["-n", "16", "--window", "8"]),
])
def test_torchrun_options_end_at_the_script(argv, launcher, script, script_args):
    args = parse(argv)
    assert args.training_script == script and args.training_script_args == script_args
    for name, value in launcher.items():
        assert getattr(args, name) == value, name


def test_what_cannot_be_resolved_fails_as_before(capsys):
    """An unknown or ambiguous option before the script goes to torchrun's own parser, which
    refuses it as it always did."""
    for argv, needle in ((["--bogus", "1", "x.py"], "unrecognized arguments: --bogus"),
                         (["--n", "2", "x.py"], "ambiguous option: --n"),
                         (["--nnodes"], "expected one argument")):
        assert torchrun_args.split_args(argv, torchrun_module.get_args_parser()) is None
        with pytest.raises(SystemExit):
            parse(argv)
        assert needle in capsys.readouterr().err


def python_with(pth_dir: Path | None) -> bool:
    """Whether torch.distributed.run comes out wrapped in a fresh interpreter that runs this
    environment's .pth files (ours left out) and then those of `pth_dir`."""
    code = f"""
import site, sys
purelib = {sysconfig.get_paths()["purelib"]!r}
sys.path.append(purelib)
for name in sorted(n for n in __import__("os").listdir(purelib) if n.endswith(".pth")):
    if name != {torchrun_args.PTH_NAME!r}:
        site.addpackage(purelib, name, set())
if {str(pth_dir) if pth_dir else None!r}:
    site.addpackage({str(pth_dir)!r}, {torchrun_args.PTH_NAME!r}, set())
import torch.distributed.run as r
print(hasattr(r.parse_args, "__wrapped__"))
"""
    proc = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip() == "True"


def test_install_writes_the_pth_that_wraps_torchrun(tmp_path):
    torchrun_args.main(["--install", "--site-packages", str(tmp_path)])
    assert (tmp_path / torchrun_args.PTH_NAME).read_text() == torchrun_args.PTH_LINE
    assert python_with(tmp_path) and not python_with(None)
    torchrun_args.main(["--uninstall", "--site-packages", str(tmp_path)])
    assert not (tmp_path / torchrun_args.PTH_NAME).exists()
