"""The real train/medusa.py on the tiny model, in process: Medusa and Hydra runs that write
checkpoints and a simulated tau, the cached features read back by a second run, exact resume,
export -> load -> the bench decoding with the head (outputs identical to AR), bad flags; and on 2
processes under torchrun, both feature modes, against 1 process."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mtpkit.data import distill
from mtpkit.eval import bench
from mtpkit.models.backbone import load_backbone
from mtpkit.models.medusa import load_head
from mtpkit.train import export, medusa

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--backbone", "tiny-llama-random", "--heads", "2", "--max-length", "128", "--log-every", "1",
        "--batch-size", "2", "--positions", "8", "--eval-prompts", "1", "--eval-max-new-tokens", "6"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("data") / "distilled.jsonl"
    distill.main(["--backbone", "tiny-llama-random", "--data", "builtin", "--limit", "6", "--max-new-tokens", "12",
                  "--out", str(out)])
    return out


def steps(metrics: Path) -> list[dict]:
    return [r for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]


def test_help_lists_every_flag(capsys):
    with pytest.raises(SystemExit):
        medusa.parse_args(["--help"])
    text = capsys.readouterr().out
    for flag in ("--config", "--backbone", "--data", "--arch", "--heads", "--layers", "--lm-head", "--prefix-layer",
                 "--distill",
                 "--positions", "--features", "--feature-cache", "--eval-tree", "--resume"):
        assert flag in text, flag
    assert "sequentially dependent" in text  # docstrings become help


@pytest.mark.parametrize("argv,needle", [(["--arch", "eagle"], "--arch must be one of"),
                                         (["--decay", "0"], "--decay must be"),
                                         (["--features", "disk"], "--features must be one of")])
def test_bad_flags_name_the_flag(capsys, argv, needle):
    with pytest.raises(SystemExit):
        medusa.parse_args(argv)
    assert needle in capsys.readouterr().err


def test_medusa_and_hydra_train_share_features_and_export(data, tmp_path):
    cache = tmp_path / "features.safetensors"
    common = [*TINY, "--data", str(data), "--feature-cache", str(cache), "--max-steps", "3", "--save-every", "3",
              "--eval-every", "3"]
    out = tmp_path / "medusa"
    result = medusa.main([*common, "--output-dir", str(out)])
    assert result["sim_tau"] >= 1.0 and len(steps(out / "metrics.jsonl")) == 3
    assert (out / "checkpoint-3" / "head" / "head.safetensors").is_file()
    written = cache.stat().st_mtime_ns
    hydra_out = tmp_path / "hydra"
    medusa.main([*common, "--output-dir", str(hydra_out), "--arch", "hydra", "--distill", "1"])
    assert cache.stat().st_mtime_ns == written  # the second run read the features back
    first = json.loads((hydra_out / "metrics.jsonl").read_text().splitlines()[0])
    assert first["feature_positions"] > 0
    config = json.loads((hydra_out / "checkpoint-3" / "head" / "mtpkit_config.json").read_text())
    assert config["method"] == "hydra" and config["heads"] == 2

    exported = tmp_path / "export"
    export.main(["--checkpoint", str(hydra_out), "--out", str(exported)])
    assert "Hydra draft heads" in (exported / "README.md").read_text()
    model, _ = load_backbone("tiny-llama-random")
    heads = load_head(exported, model)
    h = torch.randn(2, model.config.hidden_size)
    ckpt = load_head(hydra_out / "checkpoint-3", model)
    prev = torch.zeros(2, 2, dtype=torch.long)
    with torch.no_grad():
        torch.testing.assert_close(heads.logits(1, heads.hidden(1, h, prev)), ckpt.logits(1, ckpt.hidden(1, h, prev)))

    results = tmp_path / "bench" / "results.json"
    specs = [f"hydra:head={exported},tree=[[0],[1],[0,0]]", f"medusa:head={out / 'checkpoint-3'}"]
    bench.main(["--backbone", "tiny-llama-random", "--data", "builtin:eval", "--per-category", "1",
                "--max-new-tokens", "8", "--methods", *specs, "--out", str(results), "--linear", "stock"])
    saved = json.loads(results.read_text())["methods"]
    assert all(saved[spec]["matches_ar"] is True for spec in specs)


def test_resume_logs_the_same_losses(data, tmp_path):
    """Hydra++ (the prefix layer over whole sequences) interrupted at step 2 and resumed logs the
    losses of a run straight through."""
    common = [*TINY, "--data", str(data), "--feature-cache", str(tmp_path / "f.safetensors"), "--eval-every", "0",
              "--arch", "hydra", "--prefix-layer", "1"]
    straight = tmp_path / "straight"
    medusa.main([*common, "--output-dir", str(straight), "--max-steps", "4", "--save-every", "2"])
    resumed = tmp_path / "resumed"
    medusa.main([*common, "--output-dir", str(resumed), "--max-steps", "2", "--save-every", "2"])
    medusa.main([*common, "--output-dir", str(resumed), "--max-steps", "4", "--save-every", "2", "--resume", "auto"])
    a, b = steps(straight / "metrics.jsonl"), steps(resumed / "metrics.jsonl")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], rel=1e-6)



def test_sim_tau_rows_carry_training_seconds(data, tmp_path, monkeypatch):
    """Each sim_tau row's train_seconds is the training time so far: evaluation (slowed to 1 s
    here) left out, and carried on by a resumed run."""
    fast = medusa.simulated_tau

    def slow(*args):
        time.sleep(1.0)
        return fast(*args)

    monkeypatch.setattr(medusa, "simulated_tau", slow)
    common = [*TINY, "--data", str(data), "--feature-cache", str(tmp_path / "f.safetensors"), "--eval-every", "1",
              "--save-every", "2", "--output-dir", str(tmp_path / "run")]
    medusa.main([*common, "--max-steps", "2"])
    medusa.main([*common, "--max-steps", "4", "--resume", "auto"])
    rows = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) if "sim_tau" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    seconds = [r["train_seconds"] for r in rows]
    assert 0 < seconds[0] and all(a < b for a, b in zip(seconds, seconds[1:])), seconds
    assert seconds[-1] - seconds[0] < 1.0, seconds  # three evaluations of 1 s each in between: not counted

RANKS = """
import json, sys
from pathlib import Path
from safetensors.torch import save_file
from mtpkit.train import medusa

# what this process did, saved beside each checkpoint with its own copy of the heads
seen = {"hidden": 0, "written": [], "evals": 0}
backbone_hidden, replacing, save_checkpoint, simulated_tau = (medusa.backbone_hidden, medusa.replacing,
                                                              medusa.save_checkpoint, medusa.simulated_tau)

def counted_hidden(*args):
    seen["hidden"] += 1
    return backbone_hidden(*args)

def counted_replacing(path):
    seen["written"].append(Path(path).name)
    return replacing(path)

def counted_tau(*args):
    seen["evals"] += 1
    return simulated_tau(*args)

def saved(accelerator, model, optimizer, cfg, *args):
    folder = save_checkpoint(accelerator, model, optimizer, cfg, *args)
    rank, out = accelerator.process_index, Path(cfg.output_dir)
    save_file(dict(accelerator.unwrap_model(model).state_dict()), str(out / f"heads.rank{rank}.safetensors"))
    (out / f"seen.rank{rank}.json").write_text(json.dumps(seen))
    return folder

medusa.backbone_hidden, medusa.replacing, medusa.save_checkpoint, medusa.simulated_tau = (
    counted_hidden, counted_replacing, saved, counted_tau)
medusa.main(sys.argv[1:])
"""


def test_torchrun_two_processes_equal_one_with_the_same_batch(data, tmp_path):
    """Medusa on 2 processes under torchrun (through RANKS, which records what each process did),
    --features cache and online launched together, against 1 process with --grad-accum 2 (the
    same sequences and anchors a step): the same losses, and the heads identical on both processes
    and equal to the 1-process ones (the gradients are averaged). Cache: each process runs the
    backbone over its share of the sequences, the main process alone writes the cache file;
    online: each over its own micro-batches only. The simulated tau runs on the main process alone.
    --max-length 86 cuts one answer to 2 tokens, so head 3 has no target in some micro-steps of
    one process (its weights must still take part in the all-reduce)."""
    common = ["--backbone", "tiny-llama-random", "--heads", "3", "--max-length", "86", "--log-every", "1",
              "--positions", "8", "--eval-prompts", "1", "--eval-max-new-tokens", "6", "--data", str(data),
              "--max-steps", "3", "--save-every", "3", "--eval-every", "3", "--batch-size", "1"]
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH="")
    runs = {mode: [*common, "--features", mode, "--output-dir", str(tmp_path / mode)] for mode in ("cache", "online")}
    procs = {mode: subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                     "2", str(script), *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for mode, args in runs.items()}
    one = tmp_path / "one"
    try:
        medusa.main([*common, "--grad-accum", "2", "--output-dir", str(one)])
        ends = {mode: proc.communicate(timeout=300) for mode, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for mode, proc in procs.items():
        assert proc.returncode == 0, (mode, ends[mode][1][-3000:])

    reference = steps(one / "metrics.jsonl")
    heads = load_file(str(one / "checkpoint-3" / "state" / "model.safetensors"))
    for mode in ("cache", "online"):
        out = tmp_path / mode
        logged = steps(out / "metrics.jsonl")
        assert [r["step"] for r in logged] == [1, 2, 3]
        assert all(torch.isfinite(torch.tensor(r["loss"])) for r in logged)
        for key in ("loss", "loss_h1", "loss_h2", "loss_h3"):
            assert [r[key] for r in logged] == pytest.approx([r[key] for r in reference], rel=1e-5), (mode, key)
        rank0, rank1 = (load_file(str(out / f"heads.rank{r}.safetensors")) for r in (0, 1))
        for name, weight in heads.items():
            assert torch.equal(rank0[name], rank1[name]), (mode, name)
            torch.testing.assert_close(rank0[name], weight, rtol=0, atol=1e-6)
        seen = [json.loads((out / f"seen.rank{r}.json").read_text()) for r in (0, 1)]
        assert [s["evals"] for s in seen] == [1, 0], mode
        if mode == "cache":  # 3 sequences: 2 on the main process, 1 on the other
            assert seen[0]["written"] == ["features.safetensors"] and "features.safetensors" not in seen[1]["written"]
            assert [s["hidden"] for s in seen] == [2, 1]
            assert load_file(str(out / "features.safetensors"))["hidden"].equal(
                load_file(str(one / "features.safetensors"))["hidden"])
        else:  # one sequence per micro-step each
            assert [s["hidden"] for s in seen] == [3, 3] and seen[0]["written"] == seen[1]["written"] == []
