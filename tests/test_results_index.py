"""results/INDEX.md and docs/defaults-history.md: generated from committed files, and checked against them."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT

from eval import defaults_history, results_index

MACHINE = {"cpu": "Intel(R) Xeon(R) Processor", "cpu_count": 2, "torch_threads": 2, "gpu": None}
INDEX_TOML = """\
["current"]
question = "What does the default give?"
status = "current"
date = "2026-12-06"
commit = "abc1234"

["bench/old-run"]
question = "What did the earlier default give?"
status = "superseded"
date = "2026-12-01"
commit = "def5678"
machine = "AMD EPYC, 2 cores"
"""


def _report(kl_mean=0.4, kl_p99=3.0, ppl=30.0, needle_2k=0.55):
    return {"buckets": {"en": {"ppl": ppl, "teacher_ppl": 24.0, "kl_mean": kl_mean, "kl_p99": kl_p99,
                               "top1_agree": 0.7}},
            "needle": {"languages": {"en": {"by_length": {"256": 1.0, "2048": needle_2k}}}},
            "machine": MACHINE}


def _tree(tmp_path):
    """A repository with results/current (a JSON with a machine), results/bench/old-run (none) and two pages."""
    results = tmp_path / "results"
    (results / "current").mkdir(parents=True)
    (results / "current" / "qat-2of4.json").write_text(json.dumps(_report()))
    (results / "bench" / "old-run").mkdir(parents=True)
    (results / "bench" / "old-run" / "time-v.txt").write_text(
        "\tElapsed (wall clock) time (h:mm:ss or m:ss): 48:52.70\n")
    (results / "index.toml").write_text(INDEX_TOML)
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("# p\n\nThe default's evidence: [here](results/current/).\n")
    (tmp_path / "docs" / "history.md").write_text("Earlier: `results/bench/old-run/time-v.txt`.\n")
    return results


def _check(results) -> tuple[int, list[str]]:
    proc = subprocess.run([sys.executable, "-m", "eval.results_index", "--results", str(results), "--check"],
                          cwd=ROOT, capture_output=True, text=True, check=False)
    return proc.returncode, [line for line in proc.stderr.splitlines() if line]


def test_index_lists_every_entry_with_machine_status_and_citing_pages(tmp_path):
    results = _tree(tmp_path)
    assert results_index.main(["--results", str(results)]) == 0
    text = (results / "INDEX.md").read_text()
    row = next(line for line in text.splitlines() if line.startswith("| [current]"))
    assert "| Intel Xeon, 2 cores |" in row and "| abc1234 | current |" in row and "[README.md](../README.md)" in row
    row = next(line for line in text.splitlines() if line.startswith("| [bench/old-run]"))
    assert "| AMD EPYC, 2 cores |" in row and "superseded" in row and "[docs/history.md](../docs/history.md)" in row
    assert _check(results) == (0, [])


def test_check_reports_a_stale_index(tmp_path):
    results = _tree(tmp_path)
    results_index.main(["--results", str(results)])
    (results / "current" / "qat-2of4.json").write_text(json.dumps(_report() | {"machine": {"cpu": "AMD EPYC",
                                                                                          "cpu_count": 4}}))
    code, lines = _check(results)
    assert code == 1 and lines == [f"{results.name}/INDEX.md is stale (run python -m eval.results_index)"]


def test_check_reports_an_uncited_folder_and_a_folder_missing_from_the_toml(tmp_path):
    results = _tree(tmp_path)
    (results / "bench" / "new-run").mkdir()
    (results / "bench" / "new-run" / "x.json").write_text("{}")
    (tmp_path / "docs" / "history.md").write_text("nothing cited\n")
    results_index.main(["--results", str(results)])
    code, lines = _check(results)
    assert code == 1
    assert "results/bench/old-run: no page cites it (README.md, docs/*.md, <folder>/README.md)" in lines
    assert any(line.startswith("results/bench/new-run: not in index.toml") for line in lines)
    assert len(lines) == 2, lines


def test_a_top_level_folders_readme_cites_too(tmp_path):
    results = _tree(tmp_path)
    (tmp_path / "docs" / "history.md").write_text("nothing cited\n")
    (tmp_path / "experiments").mkdir()
    (tmp_path / "experiments" / "README.md").write_text("It wrote results/bench/old-run/time-v.txt.\n")
    results_index.main(["--results", str(results)])
    assert "[experiments/README.md](../experiments/README.md)" in (results / "INDEX.md").read_text()
    assert _check(results) == (0, [])


def test_check_reports_a_cited_folder_and_a_link_that_do_not_exist(tmp_path):
    results = _tree(tmp_path)
    (tmp_path / "docs" / "more.md").write_text(
        "See results/bench/gone-run and [the plot](../results/current/report.png).\n")
    results_index.main(["--results", str(results)])
    code, lines = _check(results)
    assert code == 1
    assert sorted(lines) == ["docs/more.md:1: cites results/bench/gone-run, which does not exist",
                             "docs/more.md:1: links ../results/current/report.png, which does not exist"]


def test_a_linked_report_counts_and_a_broken_link_is_reported(tmp_path):
    results = _tree(tmp_path)
    (results / "index.toml").write_text(INDEX_TOML.replace('machine = "AMD EPYC, 2 cores"\n', ""))
    (results / "bench" / "old-run" / "qat-2of4.json").symlink_to("../../current/qat-2of4.json")
    results_index.main(["--results", str(results)])
    row = next(line for line in (results / "INDEX.md").read_text().splitlines() if "[bench/old-run]" in line)
    assert "| Intel Xeon, 2 cores |" in row  # the linked report's machine
    assert _check(results) == (0, [])
    (results / "current" / "qat-2of4.json").rename(results / "current" / "moved.json")
    results_index.main(["--results", str(results)])
    code, lines = _check(results)
    assert code == 1 and lines == ["results/bench/old-run/qat-2of4.json: links ../../current/qat-2of4.json, "
                                   "which does not exist"]


def test_check_reports_incomplete_entries_a_stray_entry_and_a_duplicated_machine(tmp_path):
    results = _tree(tmp_path)
    (results / "index.toml").write_text(
        INDEX_TOML.replace('status = "current"', 'status = "maybe"').replace('commit = "abc1234"\n', "")
        + '\n["bench/vanished"]\nquestion = "?"\nstatus = "current"\ndate = "2026-12-01"\ncommit = "1"\n')
    (results / "bench" / "old-run" / "m.json").write_text(json.dumps({"machine": MACHINE}))
    results_index.main(["--results", str(results)])
    code, lines = _check(results)
    assert code == 1
    assert sorted(lines) == sorted([
        "index.toml ['current']: needs commit",
        "index.toml ['current']: status 'maybe' is not one of current, superseded, negative result",
        "index.toml ['bench/old-run']: machine is recorded in its JSONs; remove it here",
        "index.toml ['bench/vanished']: results/bench/vanished does not exist",
    ])


def test_bad_index_toml_is_a_one_line_error(tmp_path):
    results = _tree(tmp_path)
    (results / "index.toml").write_text(INDEX_TOML + 'owner = "x"\n')
    proc = subprocess.run([sys.executable, "-m", "eval.results_index", "--results", str(results)], cwd=ROOT,
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith("error:") and "unknown key 'owner'" in proc.stderr
    assert not (results / "INDEX.md").exists()


def test_stamp_fills_commit_and_date_from_git(tmp_path):
    results = _tree(tmp_path)
    (results / "index.toml").write_text(INDEX_TOML.replace('commit = "def5678"\n', "").replace(
        'date = "2026-12-01"\n', ""))
    env = {"GIT_AUTHOR_DATE": "2026-11-02T10:00:00", "GIT_COMMITTER_DATE": "2026-11-02T10:00:00"}
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git[:3] + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "add"], check=True, env={**env, "PATH": "/usr/bin:/bin"})
    head = subprocess.run(git + ["log", "--format=%h", "-1"], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert results_index.main(["--results", str(results), "--stamp"]) == 0
    index = results_index.load_index(results / "index.toml")
    assert index["bench/old-run"]["commit"] == head and index["bench/old-run"]["date"] == "2026-11-02"
    assert index["current"]["commit"] == "abc1234"  # set by hand: kept


HISTORY_TOML = """\
[[changes]]
date = "2026-12-06"
commit = "c093f64"
change = "QAT for 214 steps"
[[changes.measured]]
folder = "current"
time = "bench/old-run/time-v.txt"
qat_longer = ["current/steps.json", "current/steps.json#short"]
[[changes.measured]]
label = "the same chain, part of it"
folder = "bench/old-run"
time = "bench/old-run/time-v.txt"
scope = "QAT to the report"

[[changes]]
date = "2026-11-30"
commit = "658fc38"
change = "The first recipe file"
"""


def _history_tree(tmp_path):
    results = _tree(tmp_path)
    (results / "current" / "steps.json").write_text(json.dumps(
        {"runs/long": {"build_to_last_step_s": 1788.0}, "short": {"build_to_last_step_s": 198.0}}))
    (results / "bench" / "old-run" / "qat-2of4.json").write_text(json.dumps(_report(0.451, 3.53, 35.76, 0.6)))
    (results / "defaults-history.toml").write_text(HISTORY_TOML.replace('"current/steps.json",',
                                                                        '"current/steps.json#runs/long",'))
    page = tmp_path / "docs" / "defaults-history.md"
    page.write_text("# history\n\n<!-- defaults-history -->\nold\n<!-- /defaults-history -->\n\nprose\n")
    return results, page


def test_history_table_reads_the_reports_and_timings(tmp_path):
    results, page = _history_tree(tmp_path)
    args = ["--results", str(results), "--page", str(page)]
    assert defaults_history.main(args) == 0
    rows = [line for line in page.read_text().splitlines() if line.startswith("| ")][1:]
    # 48:52.70 + 1788 s - 198 s = 75.0 min
    assert rows[0] == ("| 2026-12-06 | `c093f64` | QAT for 214 steps | 0.400 / 3.00 | 1.25× | 55% | ≈ 75 min (two runs) "
                       "| Intel Xeon, 2 cores | [current](../results/current/) |")
    assert rows[1].startswith("|  |  | the same chain, part of it | 0.451 / 3.53 | 1.49× | 60% | 48:53 (QAT to the report) |")
    assert "| – | – | – | – | – | not measured |" in rows[2]
    assert page.read_text().endswith("<!-- /defaults-history -->\n\nprose\n")
    assert defaults_history.main(args + ["--check"]) == 0
    (results / "bench" / "old-run" / "qat-2of4.json").write_text(json.dumps(_report(0.5, 3.53, 35.76, 0.6)))
    assert defaults_history.main(args + ["--check"]) == 1


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace('"current/steps.json#short"', '"current/steps.json#nope"'), "no build_to_last_step_s"),
    (lambda t: t.replace('change = "The first recipe file"\n', ""), "needs 'change'"),
    (lambda t: t.replace('scope = "QAT', 'scop = "QAT'), "unknown key(s) ['scop']"),
])
def test_history_bad_input_is_a_one_line_error(tmp_path, edit, message):
    results, page = _history_tree(tmp_path)
    toml = results / "defaults-history.toml"
    toml.write_text(edit(toml.read_text()))
    before = page.read_text()
    proc = subprocess.run([sys.executable, "-m", "eval.defaults_history", "--results", str(results), "--page",
                           str(page)], cwd=ROOT, capture_output=True, text=True, check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
    assert page.read_text() == before


def test_committed_defaults_history_matches_results():
    assert defaults_history.main(["--results", str(ROOT / "results"),
                                  "--page", str(ROOT / "docs" / "defaults-history.md"), "--check"]) == 0


def test_committed_results_index_matches_results_and_pages():
    """Every results folder is in results/index.toml, cited by a page, and INDEX.md is up to date."""
    code, lines = _check(ROOT / "results")
    assert code == 0, "\n".join(lines)
