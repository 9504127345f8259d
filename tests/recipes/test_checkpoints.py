"""What the training scripts share on resume: the interrupted run's metric lines after the
resumed checkpoint are moved aside, not duplicated and not lost."""

import json

from mtpkit.train.checkpoints import supersede_metrics


def test_supersede_metrics_moves_only_lines_after_the_checkpoint(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": float(s)}) for s in (5, 10, 15, 20)]
    lines.insert(2, json.dumps({"step": 10, "sim_tau": 1.2}))
    lines.append("not json")
    metrics.write_text("\n".join(lines) + "\n")

    said = []
    assert supersede_metrics(metrics, 10, said.append) == 2
    assert said == ["[resume] 2 metric line(s) logged after step 10 moved to metrics.superseded.jsonl"]
    kept = metrics.read_text().splitlines()
    assert kept == [lines[0], lines[1], lines[2], "not json"]
    assert (tmp_path / "metrics.superseded.jsonl").read_text().splitlines() == [lines[3], lines[4]]

    # a second interruption appends to the same side file; nothing later than 5 stays
    assert supersede_metrics(metrics, 5, said.append) == 2
    assert metrics.read_text().splitlines() == [lines[0], "not json"]
    assert len((tmp_path / "metrics.superseded.jsonl").read_text().splitlines()) == 4
    assert supersede_metrics(tmp_path / "absent.jsonl", 5, said.append) == 0
    assert len(said) == 2  # nothing moved, nothing said


def test_supersede_metrics_keeps_a_line_with_a_unicode_line_separator_whole(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "note": "a\u2028b\x85c"}, ensure_ascii=False) for s in (1, 2, 3)]
    metrics.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert supersede_metrics(metrics, 2, lambda msg: None) == 1
    assert metrics.read_text(encoding="utf-8").split("\n") == [lines[0], lines[1], ""]
    assert (tmp_path / "metrics.superseded.jsonl").read_text(encoding="utf-8") == lines[2] + "\n"
