"""eval/ablate.py end to end on the tiny backbone: every variant trained once with the same budget,
one bench run over every head, the quality table (gated = base exactly, plain LoRA not), a
detached rerun that trains nothing, and bad input refused before anything trains."""

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mtpkit.eval import ablate, ablate_report, bench
from mtpkit.train import gated_lora

TINY_RECIPE = """# a tiny gated-LoRA recipe (the shape of configs/gated_lora/*.yaml)
backbone: tiny-llama-random
max_steps: 600
max_length: 64
log_every: 1
eval_every: 0
model:
  k: 4
  rank: 4
"""
BENCH = ["--limit", "1", "--max-new-tokens", "8", "--rounds", "1", "--quality-limit", "4",
         "--bench-args", "--linear stock"]  # stock layers: no kernel plan to time in the bench's process
VARIANTS = ["full", "no-sampler", "plain-lora"]


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    path = tmp_path_factory.mktemp("recipe") / "tiny_k4.yaml"
    path.write_text(TINY_RECIPE)
    return str(path)


def launches(log: Path) -> list[str]:
    """The trainer command lines ablate wrote into a variant's train.log, one per launch."""
    return [line for line in log.read_text().splitlines() if line.startswith("# ") and "gated_lora.py" in line]


def finished(pid: int) -> bool:
    """Whether the detached run (a child of this process) has ended; reaps it."""
    try:
        return os.waitpid(pid, os.WNOHANG)[0] == pid
    except ChildProcessError:  # already reaped (by subprocess's own clean-up)
        return True


class Ended:
    """What a Popen of a command run in this process returns: a process that has ended."""

    def __init__(self, args, returncode: int):
        self.args, self.returncode = args, returncode

    def poll(self) -> int:
        return self.returncode

    def wait(self, timeout=None) -> int:
        return self.returncode


class PartlyInProcess:
    """eval/ablate.py's `subprocess` module in this test. The first trainer launch, the first
    `--print-configs` and the detached rerun are real processes, so each of those paths stays
    tested; the other trainer launches, the second `--print-configs` and the bench run their
    script's main() in this process on the same argument list, with the same output file, exit
    status and argv, which saves a Python start with torch and transformers (about 5 s on
    2 cores) each."""

    STDOUT, DEVNULL, TimeoutExpired = subprocess.STDOUT, subprocess.DEVNULL, subprocess.TimeoutExpired

    def __init__(self):
        self.real_left = {"train": 1, "resolve": 1}  # how many launches of each kind still start a process
        self.in_process = []  # (kind, argv) of every launch run here

    @staticmethod
    def kind(cmd) -> str | None:
        script = Path(cmd[1]) if len(cmd) > 1 else None
        if script == ablate.TRAIN_SCRIPT:
            return "resolve" if "--print-configs" in cmd else "train"
        return "bench" if script == ablate.BENCH_SCRIPT else None

    def here(self, cmd) -> bool:
        kind = self.kind(cmd)
        if kind is None or self.real_left.get(kind, 0) > 0:
            if kind in self.real_left:
                self.real_left[kind] -= 1
            return False
        self.in_process.append((kind, list(cmd[2:])))
        return True

    @staticmethod
    def main(cmd, out, err, stdin="") -> int:
        """The script's main() on cmd's arguments as its process would run it: exit status."""
        script_main = bench.main if PartlyInProcess.kind(cmd) == "bench" else gated_lora.main
        saved = sys.argv, sys.stdin
        sys.argv, sys.stdin = [str(cmd[1]), *cmd[2:]], io.StringIO(stdin)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    script_main(list(cmd[2:]))
                except SystemExit as e:
                    if isinstance(e.code, str):
                        print(e.code, file=sys.stderr)
                        return 1
                    return e.code or 0
                return 0
        finally:
            sys.argv, sys.stdin = saved

    def Popen(self, cmd, **kwargs):  # noqa: N802 (subprocess's name)
        if not self.here(cmd):
            return subprocess.Popen(cmd, **kwargs)
        return Ended(cmd, self.main(cmd, kwargs["stdout"], kwargs["stdout"]))

    def run(self, cmd, input=None, capture_output=False, **kwargs):
        if not self.here(cmd):
            return subprocess.run(cmd, input=input, capture_output=capture_output, **kwargs)
        if capture_output:
            out, err = io.StringIO(), io.StringIO()
            code = self.main(cmd, out, err, input or "")
            return subprocess.CompletedProcess(cmd, code, out.getvalue(), err.getvalue())
        return subprocess.CompletedProcess(cmd, self.main(cmd, kwargs["stdout"], kwargs["stdout"]))


def test_ablation_trains_benches_and_reruns_nothing(recipe, data, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    launcher = PartlyInProcess()
    monkeypatch.setattr(ablate, "subprocess", launcher)
    out = tmp_path / "ablate"
    argv = ["--recipe", recipe, "--variants", ",".join(VARIANTS), "--max-steps", "2", "--data", str(data),
            "--out", str(out), *BENCH, "--lr", "1e-3"]  # --lr: a trainer flag, given to every variant
    report = ablate.main(argv)

    # every variant trained once, to the same step, on the same data, with its own flag
    for name in VARIANTS:
        (cmd,) = launches(out / name / "train.log")
        assert "--max-steps 2" in cmd and f"--data {data}" in cmd and cmd.endswith("--lr 1e-3")
        assert sorted(p.name for p in (out / name).glob("checkpoint-*")) == ["checkpoint-2"]
        assert (out / name / "checkpoint-2" / "trainer_state.json").is_file()
        steps = [json.loads(r)["step"] for r in (out / name / "metrics.jsonl").read_text().splitlines()]
        assert steps == [1, 2]
    assert "--gated 0" in launches(out / "plain-lora" / "train.log")[0]
    assert "--sampler 0" in launches(out / "no-sampler" / "train.log")[0]
    head_config = json.loads((out / "plain-lora" / "checkpoint-2" / "head" / "mtpkit_config.json").read_text())
    assert head_config["gated_lora"]["gated"] is False

    # one bench run holding every head: full quadratic + linear + k=2 (a k=4 head), the others quadratic
    bench_log = (out / "bench" / "bench.log").read_text()
    assert bench_log.count("eval/bench.py") == 1
    results = json.loads((out / "bench" / "results.json").read_text())
    heads = {re.search(r"head=([^,]+)", s).group(1) for s in results["methods"] if s.startswith("gated_lora")}
    assert heads == {str(out / n / "checkpoint-2" / "head") for n in VARIANTS}
    assert len([s for s in results["methods"] if s.startswith("gated_lora")]) == 5
    assert any(s.endswith("decoding=quadratic,k=2") for s in results["methods"])
    assert all(results["methods"][s]["matches_ar"] for s in results["methods"] if "plain-lora" not in s)

    # outputs; Figure 6: gated heads give the base's logits exactly, plain LoRA does not
    for name in ("ablation.json", "ablation.md", "ablation.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0
    saved = json.loads((out / "ablation.json").read_text())
    assert set(saved["curves"]) == set(VARIANTS)  # no --eval-every here: no sim_tau points
    assert all(c["points"] == [] and c["ntp_tokens_per_s"] > 0 for c in saved["curves"].values())
    quality = saved["quality"]["variants"]
    assert quality["full"]["max_abs_logit_diff"] == 0.0 and quality["no-sampler"]["max_abs_logit_diff"] == 0.0
    assert quality["full"]["ce"] == saved["quality"]["base_ce"]
    assert quality["plain-lora"]["max_abs_logit_diff"] > 0
    assert saved["quality"]["is_training_data"]
    table = (out / "ablation.md").read_text()
    for group in ("(1) sampler on/off", "(3) gated vs plain LoRA", "(4) linear vs quadratic", "(5) k (masks)"):
        assert group in table
    assert "plain-lora †" in table and "the training data (not held out)" in table
    assert report["variants"]["plain-lora"]["gated"] is False

    # the same command again, detached: it returns at once and its background run trains nothing
    logs = {n: (out / n / "train.log").stat().st_mtime_ns for n in VARIANTS}
    bench_mtime = (out / "bench" / "results.json").stat().st_mtime_ns
    capsys.readouterr()
    assert ablate.main([*argv, "--detach"]) is None
    pid = int(re.search(r"PID (\d+)", capsys.readouterr().out).group(1))
    deadline = time.time() + 120
    while time.time() < deadline and not finished(pid):
        time.sleep(0.5)
    log = out / "ablate.log"
    text = log.read_text()
    assert "[ablate] wrote" in text, text[-2000:]
    assert "configs as resolved before detaching" in text  # the trainer's parser ran in the foreground only
    for name in VARIANTS:
        assert f"{name}: skipped" in text
        assert (out / name / "train.log").stat().st_mtime_ns == logs[name]
    assert "bench: skipped" in text and (out / "bench" / "results.json").stat().st_mtime_ns == bench_mtime
    # what ran in this process rather than as a process of its own
    assert [kind for kind, _ in launcher.in_process] == ["train", "train", "bench", "resolve"]


@pytest.mark.parametrize("flags, named", [
    (["--variants", "full,bogus"], "--variants"),
    (["--max-steps", "0"], "--max-steps"),
    (["--recipe", "no/such.yaml"], "--recipe"),
    (["--variants", "full,no-sampler", "--sampler", "1"], "--sampler"),
])
def test_bad_input_fails_before_training(recipe, flags, named, tmp_path, capsys):
    out = tmp_path / "ablate"
    with pytest.raises(SystemExit) as e:
        ablate.main(["--recipe", recipe, "--out", str(out), *flags])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0]
    if named == "--variants":
        assert "known: full, no-lcm, no-sampler, basic, plain-lora" in err[0]
    assert not out.exists()  # nothing trained, nothing written


def test_variant_names():
    assert ablate.variant_flags("no-lcm+k2") == {"--lcm-weight": "0", "--k": "2"}
    assert ablate.variant_flags("basic") == {"--sampler": "0", "--lcm-weight": "0"}
    with pytest.raises(ablate.AblateError, match="--k to 2 and 3"):
        ablate.variant_flags("k2+k3")


def test_curves_put_sim_tau_against_steps_and_training_seconds(tmp_path):
    """Training seconds come from each log interval's NTP tokens over its tokens/s (evaluations
    are not in them); a resumed run's re-logged steps replace the earlier lines; a cut line is
    skipped."""
    lines = [{"step": s, "tokens_seen": 100 * s, "ntp_tokens_per_s": 100.0} for s in (1, 2)]
    lines += [{"step": 2, "sim_tau": 1.1, "eval_seconds": 50.0}, {"step": 3, "tokens_seen": 300, "ntp_tokens_per_s": 50.0}]
    lines += [{"step": 3, "tokens_seen": 300, "ntp_tokens_per_s": 100.0},  # resumed from step 2: step 3 again
              {"step": 4, "tokens_seen": 400, "ntp_tokens_per_s": 100.0}, {"step": 4, "sim_tau": 1.3}]
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "metrics.jsonl").write_text("\n".join(map(json.dumps, lines)) + '\n{"step": 5, "tok')
    runs = ablate_report.curves(tmp_path, ["a", "missing"])
    assert runs["a"]["points"] == [{"step": 2, "sim_tau": 1.1, "train_seconds": 2.0},
                                   {"step": 4, "sim_tau": 1.3, "train_seconds": 4.0}]
    assert runs["a"]["ntp_tokens_per_s"] == 100.0 and runs["missing"]["points"] == []
    text = "\n".join(ablate_report.curves_markdown(runs))
    assert "| 2 | 1.100 (2 s) |" in text and "| a | 100.0 | 1.00x | 4 |" in text
    ablate_report.write_curves(runs, tmp_path / "curves.png")
    assert (tmp_path / "curves.png").stat().st_size
