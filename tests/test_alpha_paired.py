"""eval.alpha_paired (smelt alpha-paired): two MTP modules' acceptance compared prompt by prompt."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from core.errors import SmeltError
from eval import alpha_paired

ROOT = Path(__file__).resolve().parents[1]


def _run(per_bucket: dict[str, list[float]], new_tokens: int = 64) -> dict:
    every = [a for v in per_bucket.values() for a in v]
    return {"gamma": 1, "settings": {"prompts_per_bucket": 2, "prompt_len": 128, "new_tokens": new_tokens,
                                     "languages": list(per_bucket), "greedy": True},
            "buckets": {b: {"alpha_first_per_prompt": v} for b, v in per_bucket.items()},
            "overall": {"alpha_first_per_prompt": every}}


def test_paired_differences_are_per_prompt_with_their_standard_error():
    r = alpha_paired.paired([0.2, 0.5, 0.4], [0.3, 0.5, 0.7])  # differences 0.1, 0, 0.3
    assert r["diff"] == pytest.approx(0.4 / 3) and (r["up"], r["down"], r["level"]) == (2, 0, 1)
    sd = math.sqrt(((0.1 - 0.4 / 3) ** 2 + (0.4 / 3) ** 2 + (0.3 - 0.4 / 3) ** 2) / 2)
    assert r["se"] == pytest.approx(sd / math.sqrt(3))
    both = alpha_paired.compare(_run({"en": [0.2, 0.5], "zh": [0.4, 0.4]}), _run({"en": [0.3, 0.4], "zh": [0.6, 0.4]}))
    assert both["en"]["diff"] == pytest.approx(0.0) and both["zh"]["diff"] == pytest.approx(0.1)
    assert both["all"]["prompts"] == 4 and both["all"]["diff"] == pytest.approx(0.05)
    with pytest.raises(SmeltError, match="settings.new_tokens: 64 against 32"):
        alpha_paired.compare(_run({"en": [0.2, 0.5]}), _run({"en": [0.2, 0.5]}, new_tokens=32))
    with pytest.raises(SmeltError, match=r"paired prompts \(en\): 2 against 3"):
        alpha_paired.compare(_run({"en": [0.2, 0.5]}), _run({"en": [0.2, 0.5, 0.1]}))
    old = _run({"en": [0.2, 0.5]})
    del old["buckets"]["en"]["alpha_first_per_prompt"]
    with pytest.raises(SmeltError, match="en: no alpha_first_per_prompt"):
        alpha_paired.compare(old, _run({"en": [0.2, 0.5]}))


def test_the_cli_writes_its_json_and_refuses_a_file_that_is_not_a_benchmark(tmp_path):
    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "paired.json"
    a.write_text(json.dumps(_run({"en": [0.2, 0.5]})))
    b.write_text(json.dumps(_run({"en": [0.4, 0.5]})))
    ok = subprocess.run([sys.executable, "-m", "smelt", "alpha-paired", str(a), str(b), "--out", str(out)], cwd=ROOT,
                        capture_output=True, text=True, check=False)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(out.read_text())["paired"]["all"]["diff"] == pytest.approx(0.1)
    b.write_text("{}")
    bad = subprocess.run([sys.executable, "-m", "smelt", "alpha-paired", str(a), str(b)], cwd=ROOT,
                         capture_output=True, text=True, check=False)
    assert bad.returncode != 0 and "no overall / buckets" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
