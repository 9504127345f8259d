"""One JSONL reader for every reader: lines end at b"\\n" only, a bad line (invalid JSON or
invalid UTF-8) is skipped and counted with its true line number; output paths are checked
before any work."""

import gzip
import json
import os

import pytest

from mtpkit.data import distill as distill_mod
from mtpkit.data.chat import load_examples

BREAKS = "one\u2028two\u0085three\u2029four\x1cfive"  # str.splitlines() ends a line at each of these


def _record(i, text="hi"):
    return {"id": f"r{i}", "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": text}]}


def _write_mixed(path):
    """Line 1 holds Unicode line breaks, line 2 an invalid UTF-8 byte, line 3 is blank, line 4 is
    not JSON, line 5 is fine. As data/distill.py writes (ensure_ascii=False)."""
    lines = [json.dumps(_record(1, BREAKS), ensure_ascii=False).encode(), b'{"id": "r2", "x": "\xff"}', b"",
             b"{not json", json.dumps(_record(5)).encode()]
    path.write_bytes(b"\n".join(lines) + b"\n")


def test_unicode_line_breaks_inside_a_record_are_not_line_ends(tmp_path):
    path = tmp_path / "distilled.jsonl"
    path.write_text("".join(json.dumps(_record(i, BREAKS if i == 1 else "a"), ensure_ascii=False) + "\n"
                            for i in range(1, 4)), encoding="utf-8")
    examples, report = load_examples(str(path))
    assert report.skipped == 0, report.summary()
    assert [e.id for e in examples] == ["r1", "r2", "r3"]
    assert examples[0].messages[1]["content"] == BREAKS


def test_a_bad_line_is_skipped_and_counted_at_its_true_line_number(tmp_path):
    """A bad byte costs its own line, not the whole file (the README: malformed records are
    skipped and counted)."""
    path = tmp_path / "mixed.jsonl"
    _write_mixed(path)
    examples, report = load_examples(str(path))
    assert [e.id for e in examples] == ["r1", "r5"]
    bad = report.bad_lines[str(path)]
    assert [n for n, _ in bad] == [2, 4]
    assert "UTF-8" in bad[0][1] and "invalid JSON" in bad[1][1]


def test_the_reader_numbers_every_line_and_keeps_its_bytes(tmp_path):
    from mtpkit.data.jsonl import read_jsonl

    path = tmp_path / "mixed.jsonl"
    _write_mixed(path)
    with open(path, "ab") as f:
        f.write(b'{"id": "cut')  # an interrupted write: no final newline
    zipped = tmp_path / "mixed.jsonl.gz"
    zipped.write_bytes(gzip.compress(path.read_bytes()))
    for source in (path, zipped):
        lines = read_jsonl(source)
        assert [line.number for line in lines] == [1, 2, 3, 4, 5, 6]
        assert [line.error is None for line in lines] == [True, False, False, False, True, False]
        assert lines[0].value["messages"][1]["content"] == BREAKS and lines[4].value["id"] == "r5"
        assert b"".join(line.raw for line in lines) == path.read_bytes()  # nothing lost, nothing added
        assert lines[2].blank and not lines[3].blank


def test_distill_resume_reads_the_same_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    _write_mixed(path)
    lines = distill_mod.read_lines(path)
    assert [i for i, _ in lines] == ["r1", None, None, None, "r5"]
    assert b"".join(raw for _, raw in lines) == path.read_bytes()


def _metrics(tmp_path):
    """A metrics.jsonl whose lines carry text (a note, a path) with raw Unicode line breaks."""
    rows = [{"step": 1, "loss": 2.0, "tokens_seen": 100, "ntp_tokens_per_s": 100.0, "note": BREAKS},
            {"step": 1, "sim_tau": 1.5, "note": BREAKS}]
    (tmp_path / "a").mkdir()
    metrics = tmp_path / "a" / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return metrics


def test_report_reads_metrics_with_unicode_line_breaks(tmp_path):
    from mtpkit.eval.report import write_training_plot

    write_training_plot(_metrics(tmp_path), tmp_path / "training.png")
    assert (tmp_path / "training.png").stat().st_size


def test_ablate_reads_metrics_with_unicode_line_breaks(tmp_path):
    from mtpkit.eval import ablate, ablate_report

    metrics = _metrics(tmp_path)
    assert ablate_report.curves(tmp_path, ["a"])["a"]["points"] == [{"step": 1, "sim_tau": 1.5, "train_seconds": 1.0}]
    assert ablate.last_step(metrics) == 1
    with open(metrics, "a") as f:
        f.write('{"step": 2, "lo')  # the trainer is writing its next line
    assert ablate.last_step(metrics) == 1


# --------------------------------------------------------------------------- output paths

def _unusable_out(kind, tmp_path):
    if kind == "device":
        return "/dev/full"  # only stat()ed here: reading it whole is what ran out of memory
    if kind == "fifo":
        os.mkfifo(tmp_path / "pipe")
        return str(tmp_path / "pipe")
    if kind == "folder":
        return str(tmp_path)
    (tmp_path / "file").write_text("")
    return str(tmp_path / "file" / "sub" / "x.jsonl")


NEEDLES = {"device": "not a regular file", "fifo": "not a regular file", "folder": "is a folder",
           "parent_file": "is a file, not a folder"}


@pytest.mark.parametrize("kind", sorted(NEEDLES))
def test_check_output_file_refuses_what_cannot_be_a_regular_file(kind, tmp_path):
    from mtpkit.data.jsonl import DataError, check_output_file

    path = _unusable_out(kind, tmp_path)
    with pytest.raises(DataError) as refused:
        check_output_file(path, "--out")
    message = str(refused.value)
    assert message.startswith("--out ") and NEEDLES[kind] in message and "\n" not in message
    assert (str(tmp_path / "file") if kind == "parent_file" else path) in message


def test_check_output_file_accepts_a_file_or_a_new_path(tmp_path):
    from mtpkit.data.jsonl import check_output_file

    (tmp_path / "old.jsonl").write_text("{}\n")
    for path in (tmp_path / "old.jsonl", tmp_path / "new.jsonl", tmp_path / "new" / "deeper" / "x.jsonl"):
        check_output_file(path, "--out")
    assert not (tmp_path / "new").exists()  # a check, not a mkdir


@pytest.mark.parametrize("kind", ["null_device", "fifo", "parent_file"])
def test_distill_refuses_an_unusable_out_before_any_work(kind, tmp_path, capsys, monkeypatch):
    """Refused in one line naming --out before the prompts are read or --out is (the old resume
    check read a device whole: /dev/full filled the memory)."""
    def no_work(*args, **kwargs):
        raise AssertionError("work started before --out was checked")

    for name in ("load_examples", "read_done", "read_lines", "load_backbone"):
        monkeypatch.setattr(distill_mod, name, no_work)
    out = "/dev/null" if kind == "null_device" else _unusable_out(kind, tmp_path)
    with pytest.raises(SystemExit) as stop:
        distill_mod.main(["--backbone", "tiny-llama-random", "--out", out])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("error: --out ") and len(err.strip().splitlines()) == 1, err
    assert ("is a file, not a folder" if kind == "parent_file" else "not a regular file") in err
