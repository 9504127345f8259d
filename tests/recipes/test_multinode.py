"""2-node jobs on one machine (launch/local_2node.sh: two launchers, one process per "node",
rendezvous on 127.0.0.1; launch/slurm_*.sh under a stand-in srun): both trainers, torchrun DDP and
accelerate + DeepSpeed ZeRO-2 and ZeRO-3 (with the evaluation, which under ZeRO-3 needs every
process); --max-grad-norm reaching DeepSpeed; a DeepSpeed run resumed by one launcher of 2
processes (its sharded, pickled state). DeepSpeed on CPUs compiles no C++ op (train/engine.py)."""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mtpkit.train import checkpoints, engine, gated_lora
from tests.recipes.test_gated_lora_recipe import assert_checkpoint

ROOT = Path(__file__).resolve().parents[2]
GATED = ["--backbone", "tiny-llama-random", "--k", "2", "--rank", "4", "--max-length", "128", "--log-every", "1",
         "--eval-prompts", "1", "--eval-max-new-tokens", "6"]
MTPC = ["--backbone", "tiny-byte-llama-random", "--max-length", "64", "--windows-per-sequence", "4", "--rank", "3",
        "--arch", "btree", "-n", "4", "--log-every", "1", "--eval-sequences", "2"]


def run(cmd: list[str], env: dict, timeout: int) -> subprocess.CompletedProcess:
    """`cmd` in its own process group, the whole group killed if it outlives `timeout` (a hang
    fails the test and leaves no launcher behind)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd)}: no end after {timeout} s\n{out[-3000:]}{err[-2000:]}")
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{out[-4000:]}{err[-2000:]}"
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def two_nodes(launcher: str, trainer: str, mode: str, args: list[str], timeout=240) -> str:
    """launch/local_2node.sh's output (both nodes'); a failure or a hang fails the test."""
    env = dict(os.environ, OMP_NUM_THREADS="1", ACCELERATE_DISABLE_RICH="1", PYTHONPATH="", PYTHON=sys.executable)
    return run(["bash", "launch/local_2node.sh", launcher, trainer, mode, *args, "--dist-timeout", "60"], env,
               timeout).stdout


def assert_nothing_compiled(text: str) -> None:
    """DeepSpeed on CPUs neither builds nor loads its shared-memory collectives (a C++ op, 30-50 s
    to compile; train/engine.py skip_shared_memory_collectives)."""
    assert "shm_comm" not in text and "Building extension" not in text, text[-3000:]


def losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_mtpc_torchrun_ddp_and_deepspeed_zero2_zero3_across_two_nodes(data, tmp_path):
    """The same run through torchrun (DDP), accelerate + ZeRO-2 and accelerate + ZeRO-3 with
    --eval-every, each over 2 nodes: the same losses, so all saw a world of 2 processes and the
    same batches; under ZeRO-3 the head's split weights are gathered again for its backward (its
    CircuitParams output is a tuple DeepSpeed's hooks see into) and every process evaluates."""
    common = [*MTPC, "--data", str(data), "--max-steps", "3", "--save-every", "3"]
    ddp, zero2, zero3 = tmp_path / "ddp", tmp_path / "zero2", tmp_path / "zero3"
    text = two_nodes("torchrun", "mtpc", "DDP", [*common, "--eval-every", "0", "--output-dir", str(ddp)])
    assert "[node 0] [model]" in text and "2 process(es)" in text
    text = two_nodes("accelerate", "mtpc", "ZERO2", [*common, "--eval-every", "0", "--output-dir", str(zero2)])
    assert "ZeRO stage 2 on 2 process(es)" in text
    assert_nothing_compiled(text)
    text = two_nodes("accelerate", "mtpc", "ZERO3", [*common, "--eval-every", "3", "--output-dir", str(zero3)])
    assert "ZeRO stage 3 on 2 process(es)" in text
    assert any("tf_acceptance" in json.loads(r) for r in (zero3 / "metrics.jsonl").read_text().splitlines())
    for out in (ddp, zero2, zero3):
        assert (out / "checkpoint-3" / "head" / "head.safetensors").is_file()
    assert list(losses(ddp)) == [1, 2, 3]
    assert losses(ddp) == pytest.approx(losses(zero2), rel=1e-5)
    assert losses(ddp) == pytest.approx(losses(zero3), rel=1e-5)


def test_gated_lora_zero2_and_zero3_with_evaluation_and_a_deepspeed_resume(data, tmp_path):
    """ZeRO-2 through launch/slurm_gated_lora.sh (its default accelerate config) under a stand-in
    srun, with --max-grad-norm 0.5 against the config's gradient_clipping 1.0 (the flag wins, with
    a note); ZeRO-3 through launch/local_2node.sh with --eval-every, where every process takes part
    in the simulated tau (the main process alone would wait for the others until --dist-timeout).
    Then the ZeRO-2 run resumed to step 4 by one launcher of 2 processes (`accelerate launch
    --num_processes 2` with the DeepSpeed config; without --cpu, which would make accelerate drop
    DeepSpeed for plain DDP: the trainer gives DeepSpeed gloo): its optimizer state, sharded per
    process and pickled, is refused without --trust-checkpoint 1."""
    common = ["--config", SLURM_GATED_CONFIG, *GATED, "--grad-accum", "1", "--data", str(data), "--max-steps", "2",
              "--save-every", "2"]
    zero2, zero3 = tmp_path / "zero2", tmp_path / "zero3"
    zero2_args = [*common, "--eval-every", "0", "--max-grad-norm", "0.5", "--output-dir", str(zero2)]
    proc = run(["bash", "launch/slurm_gated_lora.sh", *zero2_args[1:], "--dist-timeout", "60"], slurm_env(tmp_path),
               timeout=240)
    text = proc.stdout + proc.stderr
    assert "gradient_clipping 1.0 of the DeepSpeed/accelerate config replaced by --max-grad-norm 0.5" in text
    assert "ZeRO stage 2 on 2 process(es); gradient clipping 0.5" in text  # read back from the DeepSpeed engine
    assert_nothing_compiled(text)
    text = two_nodes("accelerate", "gated_lora", "ZERO3", [*common, "--eval-every", "2", "--output-dir", str(zero3)])
    assert "ZeRO stage 3 on 2 process(es)" in text
    rows = [json.loads(line) for line in (zero3 / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("sim_tau", 0) >= 1.0 for r in rows)
    for out in (zero2, zero3):
        assert (out / "checkpoint-2" / "head" / "adapter_model.safetensors").is_file()
    assert list(losses(zero2)) == [1, 2]
    assert losses(zero2) == pytest.approx(losses(zero3), rel=1e-5)

    assert_checkpoint(zero2, 2)
    shards = sorted(p.name for p in (zero2 / "checkpoint-2" / "state" / "pytorch_model").iterdir())
    assert [s for s in shards if s.startswith("zero_pp_rank")] == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]  # sharded
    # DeepSpeed's state is pickled: --resume refuses it without --trust-checkpoint 1 (the check the
    # trainer runs first, here on the files DeepSpeed wrote)
    with pytest.raises(SystemExit, match="--trust-checkpoint 1") as refused:
        checkpoints.resume_folder(gated_lora.parse_args([*zero2_args, "--max-steps", "4", "--resume", "auto"]))
    assert "DeepSpeed's pickled state" in str(refused.value)
    env = dict(os.environ, OMP_NUM_THREADS="1", ACCELERATE_DISABLE_RICH="1", PYTHONPATH="")
    proc = run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                "configs/accelerate/deepspeed_zero2.yaml", "--num_processes", "2", "train/gated_lora.py", *zero2_args,
                "--dist-timeout", "60", "--max-steps", "4", "--resume", "auto", "--trust-checkpoint", "1"], env, 240)
    text = proc.stdout + proc.stderr
    assert "[resume]" in text and "[deepspeed] ZeRO stage 2 on 2 process(es)" in text
    assert_checkpoint(zero2, 4)
    shards = sorted(p.name for p in (zero2 / "checkpoint-4" / "state" / "pytorch_model").iterdir())
    assert [s for s in shards if s.startswith("zero_pp_rank")] == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert list(losses(zero2)) == [1, 2, 3, 4]


def test_max_grad_norm_is_written_into_the_deepspeed_config():
    notes = []
    for before, flag, note in ((1.0, 0.5, True), ("auto", 0.5, False), (0.5, 0.5, False), (1.0, 0.0, True)):
        ds = {"gradient_clipping": before}
        engine.set_gradient_clipping(ds, flag, notes.append)
        assert ds["gradient_clipping"] == flag
        assert len(notes) == note, (before, flag)
        notes.clear()
    ds = {}
    engine.set_gradient_clipping(ds, 2.0, notes.append)
    assert ds == {"gradient_clipping": 2.0} and not notes


FAKE_SRUN = """#!/bin/bash
# srun on one machine: its command once per node, SLURM_NODEID 0..SLURM_NNODES-1 (srun's flags dropped)
while [[ $1 == --* ]]; do shift; done
for ((i = 0; i < SLURM_NNODES; i++)); do SLURM_NODEID=$i "$@" & done
rc=0; for p in $(jobs -p); do wait $p || rc=1; done; exit $rc
"""
SLURM_GATED_CONFIG = "configs/gated_lora/smollm2-135m_k4.yaml"


def slurm_env(tmp_path: Path) -> dict:
    """The environment of a 2-node SLURM job on this machine: a stand-in srun that starts each
    node's command here (each node's shell reads its own SLURM_NODEID), scontrol naming 127.0.0.1,
    and a free port for the rendezvous."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho 127.0.0.1\n")
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    return dict(os.environ, OMP_NUM_THREADS="1", ACCELERATE_DISABLE_RICH="1", PYTHONPATH="", SLURM_NNODES="2",
                SLURM_JOB_NODELIST="node[0-1]", SLURM_JOB_ID="1", GPUS_PER_NODE="1", MAIN_PORT=port,
                PATH=f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}")


def test_the_slurm_mtpc_script_starts_one_launcher_per_node(data, tmp_path):
    """launch/slurm_mtpc.sh under the stand-in srun: each node's torchrun reads its own
    SLURM_NODEID, and the two form one world. (launch/slurm_gated_lora.sh: the ZeRO-2 run of
    test_gated_lora_zero2_and_zero3_with_evaluation_and_a_deepspeed_resume.)"""
    out = tmp_path / "mtpc"
    proc = run(["bash", "launch/slurm_mtpc.sh", "configs/mtpc/byte-llama-12m_btree_n16.yaml", *MTPC, "--lora-layers",
                "0", "--data", str(data), "--max-steps", "2", "--save-every", "2", "--eval-every", "0", "--grad-accum",
                "1", "--dist-timeout", "60", "--output-dir", str(out)], slurm_env(tmp_path), timeout=180)
    assert "2 process(es)" in proc.stdout + proc.stderr
    assert list(losses(out)) == [1, 2] and (out / "checkpoint-2" / "trainer_state.json").is_file()
