"""The run report: stages in chain order, a markdown row per bucket, and a plot."""
from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT


def _rep(kl):
    return {"buckets": {b: {"ppl": 10 + kl, "kl_mean": kl, "kl_p99": 5 * kl, "top1_agree": 1 - kl / 10}
                        for b in ("en", "zh")}}


def test_report_orders_stages_and_writes_table_and_plot(tmp_path):
    (tmp_path / "evals").mkdir()
    for name, kl in (("qat-2of4", 0.2), ("teacher", 0.0), ("pruned-2of4", 0.8)):
        (tmp_path / "evals" / f"{name}.json").write_text(json.dumps(_rep(kl)))
    proc = subprocess.run([sys.executable, "-m", "eval.report", "--run", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    table = (tmp_path / "report.md").read_text()
    assert table.index("teacher") < table.index("pruned-2of4") < table.index("qat-2of4")
    assert "| pruned-2of4 | en | 10.80 | 0.800 | 4.000 | 0.920 |" in table
    assert (tmp_path / "report.png").stat().st_size > 1000


def test_report_without_evals_is_a_one_line_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "eval.report", "--run", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.startswith("error:") and proc.stderr.count("\n") == 1
