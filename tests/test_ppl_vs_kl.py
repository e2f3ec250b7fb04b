"""experiments/ppl_vs_kl.py: a bucket's log PPL ratio against its KL mean, the line through the origin."""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("ppl_vs_kl", ROOT / "experiments" / "ppl_vs_kl.py")
ppl_vs_kl = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ppl_vs_kl)


def test_the_line_through_the_origin_and_the_kl_it_puts_at_the_target():
    pts = [(kl, 0.9 * kl, f"{kl}.json") for kl in (0.4, 0.5, 0.7, 1.0)]
    r = ppl_vs_kl.fit(pts)
    assert math.isclose(r["slope"], 0.9) and math.isclose(r["corr"], 1.0) and r["resid_sd"] < 1e-12
    assert math.isclose(r["kl_mean_at_target_ratio"], math.log(1.35) / 0.9)
    noisy = ppl_vs_kl.fit([(kl, 0.9 * kl + (0.05 if i % 2 else -0.05), "") for i, (kl, _, _) in enumerate(pts)])
    assert noisy["corr"] < 1.0 and noisy["resid_sd"] > 0.04


def test_points_read_evaluations_only(tmp_path):
    ev = {"buckets": {"en": {"kl_mean": 0.5, "ppl": 36.0, "teacher_ppl": 24.0},
                      "zh": {"kl_mean": 0.7, "ppl": 40.0, "teacher_ppl": 20.0}}}
    (tmp_path / "a.json").write_text(json.dumps(ev))
    (tmp_path / "manifest.json").write_text(json.dumps({"stage": "prune"}))  # not an evaluation: left out
    pts = ppl_vs_kl.points([tmp_path])
    assert pts["en"] == [(0.5, math.log(1.5), "a.json")] and pts["zh"] == [(0.7, math.log(2.0), "a.json")]
    assert pts["code"] == [] and pts["news"] == []
