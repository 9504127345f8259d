"""Self-distillation over several processes: shards per rank, resume per rank, one merged file.

The launcher tests run the real script under torchrun / accelerate launch with 2 CPU processes;
the protocol tests run the ranks one after another in this process (RANK / WORLD_SIZE set by hand).
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mtpkit.data import distill as distill_mod

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "data" / "distill.py"
# batch size 1 and 64 tokens: ~0.1 s per record on 2 cores, a window wide enough to kill a run mid-way
ARGS = ["--backbone", "tiny-llama-random", "--data", "builtin", "--limit", "12", "--max-new-tokens", "64",
        "--batch-size", "1", "--device", "cpu", "--dtype", "float32"]
# the ranks run one after another in this process (nothing to kill): 16 tokens a record
SHORT = ARGS[:7] + ["16"] + ARGS[8:]


def _lines(path):
    return path.read_text().splitlines()


def _by_id(path):
    records = [json.loads(line) for line in _lines(path)]
    assert len({r["id"] for r in records}) == len(records), "an id written twice"
    return {r["id"]: r for r in records}


def _leftovers(folder, out):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(out.stem + ".rank"))


def _plain_env():
    env = dict(os.environ)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def _torchrun(out, *extra):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(SCRIPT),
            *ARGS, *extra, "--out", str(out)]


def _one_process(tmp_path_factory, args):
    """The records of one uninterrupted single-process run (greedy) of `args`, by id."""
    out = tmp_path_factory.mktemp("reference") / "one.jsonl"
    with pytest.MonkeyPatch.context() as mp:
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            mp.delenv(name, raising=False)
        distill_mod.main(args + ["--out", str(out)])
    records = _by_id(out)
    assert len(records) == 12
    return records


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _one_process(tmp_path_factory, ARGS)


@pytest.fixture(scope="module")
def short_reference(tmp_path_factory):
    return _one_process(tmp_path_factory, SHORT)


def _as_rank(monkeypatch, rank, world, argv):
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_RANK", str(rank))
    return distill_mod.main(argv)


def test_a_killed_torchrun_run_resumes_each_shard_under_accelerate_launch(tmp_path, reference):
    """2 processes under torchrun, killed once a shard holds a record; then `accelerate launch` (2
    processes) resumes each rank's shard and the main process merges them: the file one
    uninterrupted process writes, in prompt order, and no shard left. (One launch of each launcher:
    the resumed run takes the finishing path, waiting for every rank and merging, that an
    uninterrupted run takes.)"""
    out = tmp_path / "killed.jsonl"
    shards = [tmp_path / f"killed.rank{r}-of-2.jsonl" for r in range(2)]
    with open(tmp_path / "launcher.log", "w") as log:
        launcher = subprocess.Popen(_torchrun(out), stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
                                    env=_plain_env(), start_new_session=True)
        try:
            deadline = time.monotonic() + 90
            while not any(p.exists() and p.read_text().count("\n") >= 1 for p in shards):
                assert launcher.poll() is None, (tmp_path / "launcher.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "no shard record within 90 s"
                time.sleep(0.01)
        finally:  # torchrun passes SIGTERM on to its workers and waits for them
            os.killpg(launcher.pid, signal.SIGTERM)
            launcher.wait(timeout=60)
    partial = [_by_id(p) if p.exists() else {} for p in shards]
    assert not out.exists() and 1 <= sum(map(len, partial)) < len(reference)  # killed mid-run
    for records in partial:  # what was written is what an uninterrupted run writes
        assert all(reference[i] == r for i, r in records.items())
    with open(shards[0], "a") as f:  # a kill mid-write: half a line at the end of a shard
        f.write(json.dumps(next(iter(reference.values())))[:50])

    accelerate = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                  str(ROOT / "configs" / "accelerate" / "cpu_ddp.yaml"), str(SCRIPT), *ARGS, "--out", str(out)]
    run = subprocess.run(accelerate, capture_output=True, text=True, cwd=tmp_path, env=_plain_env(), timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "[distill rank 0/2]" in run.stderr and "[distill rank 1/2]" in run.stderr  # 2 processes, not one
    already = [int(n) for n in re.findall(r"\((\d+) already done", run.stderr)]
    assert len(already) == 2 and sum(already) == sum(map(len, partial))  # each rank resumed its own shard
    assert _by_id(out) == reference  # each id once, same greedy answers as one uninterrupted process
    assert [json.loads(line)["id"] for line in _lines(out)] == sorted(reference)  # prompt order (ids sort so)
    assert _leftovers(tmp_path, out) == []  # shards and .done files are gone after the merge


def test_a_resume_with_another_number_of_processes_reshards_what_is_missing(tmp_path, monkeypatch, short_reference):
    out = tmp_path / "d.jsonl"
    # A 2-process run of which only rank 1 finished: its shard holds the odd prompts.
    first = _as_rank(monkeypatch, 1, 2, SHORT + ["--out", str(out)])
    assert first["written"] == 6 and not out.exists()
    # Resumed on 3 processes: only the 6 missing prompts are generated, spread over the 3 ranks.
    written = [_as_rank(monkeypatch, r, 3, SHORT + ["--out", str(out)])["written"] for r in (2, 1, 0)]
    assert sum(written) == 6 and all(n >= 1 for n in written)
    assert _by_id(out) == short_reference
    assert _leftovers(tmp_path, out) == []

    # A 2-process run killed after rank 0's shard, resumed by one plain process: merged at its end.
    again = tmp_path / "e.jsonl"
    with pytest.raises(SystemExit) as stop:  # rank 0 waits for rank 1, which never comes
        _as_rank(monkeypatch, 0, 2, SHORT + ["--out", str(again), "--wait-timeout", "0.5"])
    assert stop.value.code == 2
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name)
    summary = distill_mod.main(SHORT + ["--out", str(again)])
    assert summary["already_done"] == 6 and summary["written"] == 6 and summary["merged"] == 12
    assert _by_id(again) == short_reference
    assert _leftovers(tmp_path, again) == []


def test_rank0_waiting_for_a_rank_that_never_finishes_is_a_clear_error(tmp_path, monkeypatch, capsys):
    out = tmp_path / "d.jsonl"
    small = SHORT[:5] + ["6"] + SHORT[6:]  # --limit 6
    _as_rank(monkeypatch, 1, 2, small + ["--out", str(out)])  # rank 1 of a run over 6 prompts: done
    capsys.readouterr()
    # Over 12 prompts rank 1's share is another: its old .done must not count as finished.
    with pytest.raises(SystemExit) as stop:
        _as_rank(monkeypatch, 0, 2, SHORT + ["--out", str(out), "--wait-timeout", "0.5"])
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and err[-1].startswith("error: rank(s) 1 of 2 did not finish"), err
    assert "d.rank1-of-2.jsonl" in err[-1] and "--wait-timeout" in err[-1]
    assert not out.exists()  # nothing merged early
    assert _leftovers(tmp_path, out) == ["d.rank0-of-2.done", "d.rank0-of-2.jsonl", "d.rank1-of-2.done",
                                         "d.rank1-of-2.jsonl"]  # kept for a resume


def test_launcher_environment_is_checked(tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit) as stop:
        _as_rank(monkeypatch, 2, 2, ARGS + ["--out", str(tmp_path / "x.jsonl")])
    assert stop.value.code == 2 and "RANK=2 WORLD_SIZE=2" in capsys.readouterr().err


def test_merge_keeps_the_output_and_adds_each_missing_id_once_in_prompt_order(tmp_path):
    from mtpkit.data.chat import Example

    def line(i):
        return json.dumps({"id": i, "messages": []}) + "\n"

    out = tmp_path / "m.jsonl"
    out.write_text(line("a") + line("b") + line("c")[:9])  # a run killed mid-write left half a line
    (tmp_path / "m.rank0-of-2.jsonl").write_text(line("b") + line("c") + line("x")[:5])
    (tmp_path / "m.rank1-of-3.jsonl").write_text(line("d") + line("c") + line("zz"))
    (tmp_path / "m.rank0-of-2.done").write_text("whatever\n")
    examples = [Example(id=i, messages=[]) for i in "dcba"]
    assert distill_mod.merge_shards(out, examples) == 5
    assert [json.loads(x)["id"] for x in _lines(out)] == ["a", "b", "d", "c", "zz"]
    assert _leftovers(tmp_path, out) == []
