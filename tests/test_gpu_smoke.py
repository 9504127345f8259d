"""launch/gpu_smoke.sh end to end on the CPU (`--device cpu`), on the tiny backbones, as small as
every stage allows: one step of each trainer on 2 distilled prompts, the MTPC config's n = 16 head
over 16 windows a sequence (its 256 take seconds a step on a CPU)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_smoke_runs_every_stage_on_cpu(tmp_path):
    out = tmp_path / "smoke"
    proc = subprocess.run(
        ["bash", str(ROOT / "launch/gpu_smoke.sh"), "--device", "cpu", "--dtype", "float32",
         "--backbone", "tiny-llama-random", "--byte-backbone", "tiny-byte-llama-random",
         "--steps", "1", "--prompts", "2", "--tokens", "8", "--mtpc-flags", "--windows-per-sequence 16 --grad-accum 1",
         "--out", str(out), "--python", sys.executable],
        cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    gated = json.loads((out / "bench/results.json").read_text())
    mtpc = json.loads((out / "bench_mtpc/results.json").read_text())
    assert {"ar", "probe:bc=10"} <= set(gated["methods"])
    assert any(m.startswith("gated_lora:") for m in gated["methods"])
    assert any(m.startswith("mtpc:") for m in mtpc["methods"])
    for run in (gated, mtpc):
        assert run["config"]["device"] == "cpu"
        for name, m in run["methods"].items():
            assert m["tokens_per_s"] > 0, name
            # hf_ar has no tau; MTPC's Algorithm 2 drops the bonus token of a step that accepts
            # nothing, so an untrained head can sit below 1
            assert m["tau"] is None or m["tau"] >= (0.5 if name.startswith("mtpc") else 1.0), name
            assert m["matches_ar"], name  # greedy: every drafter's output is AR's
    summary = proc.stdout[proc.stdout.index("[gpu_smoke] summary"):]
    assert summary.count("tiny-llama-random") >= 3 and "tiny-byte-llama-random" in summary
    for stage in ("1/6", "2/6", "3/6", "4/6", "5/6", "6/6"):
        assert f"[gpu_smoke" in proc.stdout and stage in proc.stdout
