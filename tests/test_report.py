"""The run report: stages in chain order, a markdown row per bucket, and a plot."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT


def _rep(kl):
    return {"buckets": {b: {"ppl": 10 + kl, "kl_mean": kl, "kl_p99": 5 * kl, "top1_agree": 1 - kl / 10}
                        for b in ("en", "zh")}}


def test_report_orders_stages_and_writes_table_and_plot(tmp_path):
    (tmp_path / "evals").mkdir()
    for name, kl in (("qat-2of4", 0.2), ("teacher", 0.0), ("recovered-2of4", 0.6), ("pruned-2of4", 0.8),
                     ("reconstructed-2of4", 0.5)):
        (tmp_path / "evals" / f"{name}.json").write_text(json.dumps(_rep(kl)))
    proc = subprocess.run([sys.executable, "-m", "eval.report", "--run", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    table = (tmp_path / "report.md").read_text()
    assert (table.index("teacher") < table.index("pruned-2of4") < table.index("reconstructed-2of4")
            < table.index("recovered-2of4") < table.index("qat-2of4"))
    assert "| pruned-2of4 | en | 10.80 | 0.800 | 4.000 | 0.920 |" in table
    assert (tmp_path / "report.png").stat().st_size > 1000


def test_report_draws_the_needle_heatmaps_of_stages_evaluated_with_needle(tmp_path):
    cells = [{"length": n, "depth": d, "correct": c, "total": 2} for n, d, c in
             ((256, 0.0, 2), (256, 1.0, 1), (512, 0.0, 2), (512, 1.0, 0))]
    needle = {"languages": {"en": {"accuracy": 5 / 8, "by_length": {"256": 0.75, "512": 0.5}, "cells": cells}}}
    (tmp_path / "evals").mkdir()
    (tmp_path / "evals" / "teacher.json").write_text(json.dumps({**_rep(0.0), "needle": needle}))
    (tmp_path / "evals" / "pruned-2of4.json").write_text(json.dumps(_rep(0.8)))  # evaluated without --needle
    proc = subprocess.run([sys.executable, "-m", "eval.report", "--run", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "needle.png").stat().st_size > 1000
    from eval.needle import grid

    assert grid({"languages": needle["languages"]}, "en") == ([256, 512], [0.0, 1.0], [[1.0, 0.5], [1.0, 0.0]])


def test_report_without_evals_is_a_one_line_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "eval.report", "--run", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 2 and proc.stderr.startswith("error:") and proc.stderr.count("\n") == 1


def _cdf_rep(kl, cdf=True):
    """A report like eval.evaluate's: quantiles of an exponential per-token KL with mean `kl`."""
    import math

    from eval.metrics import KL_CDF_P

    rep = _rep(kl)
    for m in rep["buckets"].values():
        if cdf:
            m["kl_cdf"] = {"p": KL_CDF_P, "kl": [-kl * math.log(1 - p) for p in KL_CDF_P]}
    return rep


def test_report_figure_has_bars_and_kl_distribution_per_bucket(tmp_path):
    from eval.report import figure, plot

    reports = {"teacher": _cdf_rep(0.0), "pruned-2of4": _cdf_rep(0.98), "recovered": _cdf_rep(0.64),
               "rtn-old": _cdf_rep(0.4, cdf=False)}
    fig = figure(reports)
    assert len(fig.axes) == 3 * 2  # rows KL mean, KL P99, KL distribution; one column per bucket (en, zh)
    mean_en, tail_en = fig.axes[0], fig.axes[4]
    heights = [p.get_height() for p in mean_en.patches]
    assert heights == [0.0, 0.98, 0.64, 0.4] and mean_en.get_yscale() == "linear"  # teacher drawn as 0
    assert "0" in [t.get_text() for t in mean_en.texts] and "0.980" in [t.get_text() for t in mean_en.texts]
    curves = [line.get_label() for line in tail_en.get_lines() if not line.get_label().startswith("_")]
    assert tail_en.get_xscale() == "log" and curves == ["pruned-2of4", "recovered"]
    note = " ".join(t.get_text() for t in tail_en.texts)
    assert "rtn-old (no kl_cdf" in note and "teacher" in note
    plot(reports, tmp_path / "report.png")
    assert (tmp_path / "report.png").stat().st_size > 20_000
    assert [p.name for p in tmp_path.iterdir()] == ["report.png"]  # no temp file left behind


SECTION_TOML = '''
[[rows]]
label = "dense teacher"
file = "teacher.json"

[[rows]]
label = "SparseGPT 2:4"
file = "sparsegpt.json"
commands = ["python -m prune.run --method sparsegpt --pattern 2:4 --out runs/x/sp"]
'''
MACHINE = {"cpu": "Test CPU 9000", "cpu_count": 2, "torch_threads": 2, "torch": "2.14.1"}
README = "# project\n\nprose above\n\n<!-- results:prune -->\nstale\n<!-- /results:prune -->\n\nprose below\n"


def _results(tmp_path):
    sec = tmp_path / "results" / "prune"
    sec.mkdir(parents=True)
    (sec / "section.toml").write_text(SECTION_TOML)
    for name, kl in (("teacher", 0.0), ("sparsegpt", 0.985)):
        rep = {**_cdf_rep(kl), "machine": MACHINE, "settings": {"seq_len": 512, "windows": {"en": 16, "zh": 8}},
               "command": f"python -m eval.evaluate --model runs/x/{name} --out {name}.json"}
        (sec / f"{name}.json").write_text(json.dumps(rep))
    readme = tmp_path / "README.md"
    readme.write_text(README)
    return tmp_path / "results", readme


def test_tables_render_between_markers_and_check_detects_stale_readme(tmp_path, capsys):
    from eval.tables import main

    results, readme = _results(tmp_path)
    args = ["--results", str(results), str(readme)]
    assert main([*args, "--check"]) == 1
    err = capsys.readouterr().err
    assert f"{readme} is stale" in err and "prune" in err
    assert main(args) == 0
    text = readme.read_text()
    assert text.startswith("# project\n\nprose above\n\n<!-- results:prune -->\n")
    assert text.endswith("<!-- /results:prune -->\n\nprose below\n") and "stale" not in text
    assert "| model | en PPL | en KL mean | en KL P99 | en top-1 | zh PPL |" in text
    assert "| SparseGPT 2:4 | 10.98 | 0.985 | 4.925 | 0.901 |" in text
    assert "| dense teacher | 10.00 | 0.000 | 0.000 | 1.000 |" in text
    assert "Measured on Test CPU 9000, 2 threads, torch 2.14.1; evaluation windows en 16 / zh 8 × 512" in text
    assert "python -m prune.run --method sparsegpt" in text and "eval.evaluate --model runs/x/sparsegpt" in text
    assert text.index("dense teacher") < text.index("SparseGPT 2:4")  # section.toml's order
    assert main([*args, "--check"]) == 0
    # a re-measured report makes the README stale again; regenerating is a no-op once up to date
    rep = json.loads((results / "prune" / "sparsegpt.json").read_text())
    rep["buckets"]["en"]["kl_mean"] = 0.5
    (results / "prune" / "sparsegpt.json").write_text(json.dumps(rep))
    assert main([*args, "--check"]) == 1
    assert main(args) == 0 and "| SparseGPT 2:4 | 10.98 | 0.500 |" in readme.read_text()
    assert main([*args, "--check"]) == 0


def _second_section(results):
    sec = results / "ptq"
    sec.mkdir()
    (sec / "section.toml").write_text('[[rows]]\nlabel = "RTN"\nfile = "rtn.json"\n')
    (sec / "rtn.json").write_text(json.dumps({**_cdf_rep(0.392), "command": "python -m eval.evaluate --out rtn.json"}))


def test_tables_render_each_section_into_the_file_holding_its_markers(tmp_path, capsys):
    from eval.tables import main

    results, readme = _results(tmp_path)
    _second_section(results)
    (results / "bench").mkdir()  # a folder without section.toml holds other evidence: not a table
    (results / "bench" / "speed.json").write_text("{}")
    page = tmp_path / "docs" / "quantization.md"
    page.parent.mkdir()
    page.write_text("# Quantization\n\n<!-- results:ptq -->\n<!-- /results:ptq -->\n")
    args = ["--results", str(results), str(readme), str(page)]
    assert main(args) == 0
    assert "| RTN | 10.39 | 0.392 |" in page.read_text() and "RTN" not in readme.read_text()
    assert "SparseGPT 2:4" in readme.read_text() and "SparseGPT" not in page.read_text()
    assert main([*args, "--check"]) == 0
    # --check names the stale file and its section, and only that one
    (results / "ptq" / "rtn.json").write_text(json.dumps(_cdf_rep(0.5)))
    capsys.readouterr()
    assert main([*args, "--check"]) == 1
    err = capsys.readouterr().err
    assert f"{page} is stale: results section(s) ptq differ" in err and str(readme) not in err
    # with no files named, README.md and docs/*.md of the current directory are read
    proc = subprocess.run([sys.executable, "-m", "eval.tables", "--results", str(results)], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "wrote docs/quantization.md: ptq" in proc.stdout and "| RTN | 10.50 | 0.500 |" in page.read_text()


def test_tables_a_section_is_rendered_in_exactly_one_file(tmp_path):
    from core.errors import SmeltError
    from eval.tables import main

    results, readme = _results(tmp_path)
    page = tmp_path / "page.md"
    page.write_text("<!-- results:prune -->\n<!-- /results:prune -->\n")
    before = readme.read_text()
    with pytest.raises(SmeltError, match=f"results section prune has markers in both {readme} and {page}"):
        main(["--results", str(results), str(readme), str(page)])
    assert readme.read_text() == before and "|" not in page.read_text()  # nothing half-written
    _second_section(results)
    with pytest.raises(SmeltError, match="no markdown file has <!-- results:ptq --> .* results section ptq"):
        main(["--results", str(results), str(readme)])
    page.write_text("<!-- results:ptq -->\n")
    with pytest.raises(SmeltError, match=f"{page} has <!-- results:ptq --> without its <!-- /results:ptq -->"):
        main(["--results", str(results), str(readme), str(page)])


def test_tables_render_a_chain_section_through_its_kind(tmp_path):
    from eval.tables import main

    results, readme = _results(tmp_path)
    sec = results / "current"
    sec.mkdir()
    (sec / "section.toml").write_text('kind = "chain"\nbuckets = ["en"]\n\n[[rows]]\nlabel = "teacher"\n'
                                      'file = "teacher.json"\n\n[[rows]]\nlabel = "release"\nfile = "qat.json"\n')
    (sec / "teacher.json").write_text(json.dumps(_cdf_rep(0.0)))
    (sec / "qat.json").write_text(json.dumps(_cdf_rep(0.388)))
    (sec / "qat.manifest.json").write_text("{}")  # a chain folder holds its evidence, not only listed reports
    readme.write_text(README + "<!-- results:current -->\n<!-- /results:current -->\n")
    assert main(["--results", str(results), str(readme)]) == 0
    assert "| release | 0.388 / 1.94 | 10.39 (1.04×) |" in readme.read_text()


def test_tables_section_json_and_bad_sections(tmp_path):
    from core.errors import SmeltError
    from eval.tables import main

    results, readme = _results(tmp_path)
    args = ["--results", str(results), str(readme)]
    sec = results / "prune"
    (sec / "section.toml").unlink()
    (sec / "section.json").write_text(json.dumps({"buckets": ["zh"], "rows": [
        {"label": "t", "file": "teacher.json"}, {"label": "s", "file": "sparsegpt.json", "commands": "cmd"}]}))
    assert main(args) == 0 and "| model | zh PPL | zh KL mean | zh KL P99 | zh top-1 |\n" in readme.read_text()
    (sec / "extra.json").write_text("{}")
    with pytest.raises(SmeltError, match="extra.json not listed"):
        main(args)
    (sec / "extra.json").unlink()
    (sec / "section.toml").write_text(SECTION_TOML)
    with pytest.raises(SmeltError, match="both section.toml and section.json"):
        main(args)
    (sec / "section.json").unlink()
    (sec / "section.toml").write_text('kind = "histogram"\n' + SECTION_TOML)
    with pytest.raises(SmeltError, match="section.toml: kind 'histogram' is not one of chain, evaluations"):
        main(args)
    (sec / "section.toml").write_text(SECTION_TOML)
    readme.write_text(README + "<!-- results:gone -->\n<!-- /results:gone -->\n")
    with pytest.raises(SmeltError, match="has markers for results section gone, which has no"):
        main(args)


def test_tables_missing_markers_is_a_one_line_error_naming_the_section(tmp_path):
    results, readme = _results(tmp_path)
    readme.write_text("# project\n\nno markers here\n")
    proc = subprocess.run([sys.executable, "-m", "eval.tables", "--results", str(results), str(readme)],
                          cwd=ROOT, capture_output=True, text=True, check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("error:") and "<!-- results:prune -->" in proc.stderr and "section prune" in proc.stderr
    assert readme.read_text() == "# project\n\nno markers here\n"


def test_committed_docs_match_results():
    """The generated tables of README.md and docs/*.md equal what results/ gives: every number matches its JSON."""
    from eval.tables import main

    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert main(["--results", str(ROOT / "results"), *map(str, files), "--check"]) == 0
