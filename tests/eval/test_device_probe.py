"""eval/device_probe.py on a CPU and the tiny backbone: every measure the CPU has, the CUDA-only
ones absent, and the floors derived from the measures as the docstring says."""

import json

import pytest
import torch

from mtpkit.eval import device_probe


def test_the_op_counter_counts_aten_ops():
    x = torch.ones(3)
    with device_probe.CountOps() as counter:
        (x + 1).mul_(2)
    assert counter.count == 2


def test_the_probe_on_a_cpu(tmp_path, capsys):
    out = tmp_path / "device.json"
    results = device_probe.main(["--backbone", "tiny-llama-random", "--tokens", "3", "--repeats", "2",
                                 "--compile", "0", "--device", "cpu", "--out", str(out)])
    assert json.loads(out.read_text()) == results
    for key in ("op_us", "copy_GBps", "hf_eager_ms"):
        assert results[key]["min"] <= results[key]["median"] <= results[key]["max"], key
    assert results["ops_per_step"] > 20  # a 2-layer Llama step is dozens of ops
    assert not {"sync_us", "item_us", "graph_replay_us", "graph_floor_ms", "hf_static_compiled_ms"} & set(results)
    assert results["memory_floor_ms"] == pytest.approx(results["weight_MB"] * 1e6 / (results["copy_GBps"]["median"] * 1e9) * 1e3)
    assert results["dispatch_floor_ms"] == pytest.approx(results["ops_per_step"] * results["op_us"]["median"] / 1e3)
    assert results["floor_ms"] == max(results["memory_floor_ms"], results["dispatch_floor_ms"])
    assert results["bound"] == ("host" if results["dispatch_floor_ms"] > results["memory_floor_ms"] else "memory")
    assert "| ops_per_step |" in capsys.readouterr().out


def test_bad_flags_are_refused(capsys):
    with pytest.raises(SystemExit):
        device_probe.parse_args(["--tokens", "1"])
    assert "--tokens must be >= 2" in capsys.readouterr().err
