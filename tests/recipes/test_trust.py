"""--resume reads tensors and JSON only: a checkpoint whose state/ is pickled (DeepSpeed's, or
accelerate's of the earlier layout) is refused before anything is unpickled, unless
--trust-checkpoint 1."""

import json
import pickle
from pathlib import Path

import pytest

from mtpkit.train import byte_lm, mtpc


class Hostile:
    """Unpickling this writes a marker file (hostile code would do worse)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "unpickled"))


@pytest.mark.parametrize("kind", ["accelerate", "deepspeed"])
def test_a_pickled_resume_state_is_refused_without_trust(tmp_path, kind):
    ckpt, marker = tmp_path / "run" / "checkpoint-2", tmp_path / "ran.txt"
    state = ckpt / "state"
    (state / "pytorch_model" if kind == "deepspeed" else state).mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 2, "micro_step": 2}))
    for name in ("random_states_0.pkl", "custom_checkpoint_0.pkl", "optimizer.bin"):
        (state / name).write_bytes(pickle.dumps(Hostile(marker)))
    with pytest.raises(SystemExit) as e:
        byte_lm.main(["--output-dir", str(tmp_path / "run"), "--resume", "auto", "--stdlib-mb", "0"])
    message = str(e.value)
    assert "--trust-checkpoint 1" in message and str(ckpt) in message and "\n" not in message
    assert ("DeepSpeed" in message) == (kind == "deepspeed")
    assert not marker.exists()


def test_a_safe_checkpoint_holds_no_pickle_and_resumes_without_trust(tmp_path):
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"Add {i} and 1."},
                                                       {"role": "assistant", "content": f"{i + 1}. Done."}]})
                              for i in range(8)) + "\n")
    args = ["--backbone", "tiny-byte-llama-random", "--max-length", "64", "--windows-per-sequence", "4",
            "--arch", "cp", "-n", "4", "--rank", "3", "--eval-every", "0", "--data", str(data),
            "--output-dir", str(tmp_path / "run")]
    mtpc.main([*args, "--max-steps", "1"])
    files = [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    assert not [p.name for p in files if p.suffix in (".pkl", ".bin", ".pt", ".pth")]
    for p in (tmp_path / "run" / "checkpoint-1" / "state").iterdir():
        assert p.suffix in (".json", ".safetensors"), p.name
    mtpc.main([*args, "--max-steps", "2", "--resume", "auto"])
