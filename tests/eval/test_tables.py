import json
import re

import pytest

from mtpkit.eval import bench, tables
from mtpkit.eval.report import timing_warnings

BENCH_ARGS = ["--backbone", "tiny-llama-random", "--data", "builtin:eval", "--per-category", "1",
              "--max-new-tokens", "8", "--methods", "ar", "pld"]


@pytest.fixture(scope="module")
def bench_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "results.json"
    bench.main(BENCH_ARGS + ["--out", str(out)])
    return out


@pytest.fixture
def repo(tmp_path, bench_results):
    """A tiny checkout: a README and a docs page with table blocks, and the table's results file."""
    command = "python eval/bench.py " + " ".join(BENCH_ARGS)
    assert tables.main(["--root", str(tmp_path), "collect", "tiny", str(bench_results), "--command", command]) == 0
    (tmp_path / "README.md").write_text("# title\n\n<!-- table:tiny -->\n<!-- /table:tiny -->\n\nafter\n")
    (tmp_path / "docs" / "page.md").write_text("text\n<!-- table:tiny -->\nold\n<!-- /table:tiny -->\n")
    return tmp_path


def row(text: str, spec: str) -> list[str]:
    line = next(line for line in text.splitlines() if line.startswith(f"| {spec} |"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_collect_keeps_the_summary_and_no_prompt_data(repo, bench_results):
    kept = json.loads((repo / "docs" / "results" / "tiny.json").read_text())
    results = json.loads(bench_results.read_text())
    assert kept["command"].startswith("python eval/bench.py") and re.fullmatch(r"\d{4}-\d\d-\d\d", kept["date"])
    assert kept["config"] == results["config"] and list(kept["methods"]) == list(results["methods"])
    for key in ("rounds", "machine", "warnings"):  # the timing's trustworthiness travels with it
        assert kept[key] == results[key]
    for spec, r in results["methods"].items():
        for key in ("tau", "tokens_per_s", "speedup_vs_ar", "speedup_vs_ar_spread", "matches_ar", "target_ms_per_call",
                    "accept_counts"):
            assert kept["methods"][spec].get(key) == r.get(key)  # hf_ar has no target calls
        assert kept["methods"][spec]["per_category"]["code"]["tau"] == r["per_category"]["code"]["tau"]
    text = json.dumps(kept)
    assert "outputs" not in text and "output_ids" not in text and "prompt_ids" not in text


def test_render_writes_the_results_numbers_and_the_command(repo, bench_results):
    assert tables.main(["--root", str(repo), "render"]) == 0
    results = json.loads(bench_results.read_text())
    flagged = timing_warnings(results)[1]  # a timing warning's ratio carries a mark
    for path in (repo / "README.md", repo / "docs" / "page.md"):
        text = path.read_text()
        for spec, r in results["methods"].items():
            cells = row(text, spec)  # method | tau | tokens/s | speed-up vs AR | ...
            assert cells[1] == ("-" if r["tau"] is None else f"{r['tau']:.2f}")  # hf_ar: no tau
            assert cells[2] == f"{r['tokens_per_s']:.1f}"
            assert cells[3] == f"{r['speedup_vs_ar']:.2f}" + (" !" if (spec, None) in flagged else "")
            assert cells[-1] == ("yes" if r["matches_ar"] else cells[-1])
        assert "python eval/bench.py " + " ".join(BENCH_ARGS) in text
        assert "python eval/tables.py collect tiny" in text
    readme = (repo / "README.md").read_text()
    assert readme.startswith("# title\n\n<!-- table:tiny -->\n") and readme.endswith("<!-- /table:tiny -->\n\nafter\n")
    assert "old" not in (repo / "docs" / "page.md").read_text()
    assert tables.main(["--root", str(repo), "render", "--check"]) == 0  # rendering twice changes nothing


def test_a_step_floor_of_another_version_is_not_rendered(repo):
    """x rows of another statistic (an older `FLOOR_VERSION`, or none recorded) are another
    number: their columns leave the table; the current version's stay."""
    source = repo / "docs" / "results" / "tiny.json"
    kept = json.loads(source.read_text())
    assert kept["methods"]["ar"]["floor_version"] == tables.FLOOR_VERSION
    assert tables.main(["--root", str(repo), "render"]) == 0
    assert "| x rows |" in (repo / "README.md").read_text()
    for method in kept["methods"].values():
        method["floor_version"] = tables.FLOOR_VERSION - 1
    source.write_text(json.dumps(kept))
    assert tables.main(["--root", str(repo), "render"]) == 0
    text = (repo / "README.md").read_text()
    assert "| x rows |" not in text and "x rows, own work apart" not in text and "| host reads |" in text


def test_check_names_a_hand_edited_number(repo, bench_results, capsys):
    tables.main(["--root", str(repo), "render"])
    page = repo / "docs" / "page.md"
    tau = f"{json.loads(bench_results.read_text())['methods']['pld']['tau']:.2f}"
    edited = page.read_text().replace(f"| pld | {tau} |", "| pld | 9.99 |")
    assert edited != page.read_text()
    page.write_text(edited)
    capsys.readouterr()
    assert tables.main(["--root", str(repo), "render", "--check"]) == 1
    err = capsys.readouterr().err
    assert "docs/page.md:tiny" in err and "README.md" not in err
    assert page.read_text() == edited  # --check writes nothing
    assert tables.main(["--root", str(repo), "render"]) == 0 and f"| pld | {tau} |" in page.read_text()


def test_a_block_without_results_is_an_error_naming_it(repo, capsys):
    (repo / "docs" / "other.md").write_text("<!-- table:nope -->\n<!-- /table:nope -->\n")
    before = (repo / "README.md").read_text()
    assert tables.main(["--root", str(repo), "render"]) == 2
    err = capsys.readouterr().err
    assert "'nope'" in err and "docs/results/nope.json" in err and "tables.py collect nope" in err
    assert (repo / "README.md").read_text() == before  # an error writes nothing


def test_an_unclosed_block_is_an_error(repo, capsys):
    (repo / "docs" / "other.md").write_text("<!-- table:tiny -->\nno end\n")
    assert tables.main(["--root", str(repo), "render", "--check"]) == 2
    assert "no matching <!-- /table:tiny -->" in capsys.readouterr().err


def test_the_repository_tables_are_in_sync_with_docs_results(capsys):
    """README.md and docs/*.md show exactly what docs/results/*.json hold (run
    `python eval/tables.py render` after `collect`)."""
    code = tables.main(["render", "--check"])
    assert code == 0, capsys.readouterr().err


def test_curve_keeps_sim_tau_against_seconds_and_renders_them(tmp_path, capsys):
    """`curve` reads each run's sim_tau rows and its block renders every point; a run without
    train_seconds is refused."""
    heads, lora = tmp_path / "heads", tmp_path / "lora"
    heads.mkdir(), lora.mkdir()
    (heads / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"step": 0, "features_seconds": 100.0}, {"step": 10, "loss": 2.0},
        {"step": 10, "sim_tau": 1.5, "train_seconds": 20.0, "eval_seconds": 3.0},
        {"step": 20, "sim_tau": 1.75, "train_seconds": 40.0, "eval_seconds": 3.0}]) + "\n")
    (lora / "metrics.jsonl").write_text(json.dumps({"step": 5, "sim_tau": 1.125, "train_seconds": 60.0}) + "\n")
    args = ["--root", str(tmp_path), "curve", "cv", f"hydra={heads}", f"gated={lora}", "--command", "make x"]
    assert tables.main(args + ["--plot", str(tmp_path / "cv.png")]) == 0
    saved = json.loads((tmp_path / "docs" / "results" / "cv.json").read_text())
    assert saved["runs"]["hydra"]["points"] == [{"step": 10, "train_seconds": 20.0, "sim_tau": 1.5},
                                                {"step": 20, "train_seconds": 40.0, "sim_tau": 1.75}]
    assert (tmp_path / "cv.png").stat().st_size > 0
    (tmp_path / "docs" / "page.md").write_text("<!-- table:cv -->\n<!-- /table:cv -->\n")
    assert tables.main(["--root", str(tmp_path), "render"]) == 0
    text = (tmp_path / "docs" / "page.md").read_text()
    assert "| hydra | 10 / 20 | 20 / 40 | 1.500 / 1.750 |" in text and "| gated | 5 | 60 | 1.125 |" in text and "make x" in text
    assert tables.main(["--root", str(tmp_path), "render", "--check"]) == 0
    (lora / "metrics.jsonl").write_text(json.dumps({"step": 5, "sim_tau": 1.1}) + "\n")
    assert tables.main(args) == 2
    assert "train_seconds" in capsys.readouterr().err
