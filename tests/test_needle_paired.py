"""eval.needle_paired (smelt needle-paired): prompt-by-prompt comparison of needle grids."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from core.errors import SmeltError
from eval import needle_paired

ROOT = Path(__file__).resolve().parents[1]


def _grid(correct: list[bool]) -> dict:
    prompts = [{"length": 256 if i % 2 else 512, "depth": 0.5, "name": f"N{i}", "value": 1000 + i,
                "answer": "", "correct": c} for i, c in enumerate(correct)]
    return {"languages": {"en": {"prompts": prompts}}}


def test_mcnemar_exact_p_values():
    assert needle_paired.mcnemar_p(0, 0) == 1.0
    assert needle_paired.mcnemar_p(3, 3) == 1.0
    assert needle_paired.mcnemar_p(5, 0) == pytest.approx(2 / 32)  # both tails of Binomial(5, 1/2)
    assert needle_paired.mcnemar_p(16, 4) == pytest.approx(2 * sum(math.comb(20, i) for i in range(5)) / 2 ** 20)


def test_paired_counts_and_refusals(tmp_path):
    ref = [True] * 6 + [False] * 2
    other = [False, False, False, True, True, True, True, False]  # lost 3 (0, 1, 2), won 1 (6)
    rows = needle_paired.compare(_grid(ref)["languages"]["en"]["prompts"],
                                 _grid(other)["languages"]["en"]["prompts"])
    assert (rows["all"]["lost"], rows["all"]["won"], rows["all"]["prompts"]) == (3, 1, 8)
    assert rows["all"]["reference"] == 0.75 and rows["all"]["this"] == 0.5
    assert rows["512"]["lost"] + rows["256"]["lost"] == 3 and rows["512"]["prompts"] == 4
    shifted = _grid(other)
    shifted["languages"]["en"]["prompts"][0]["value"] = 1  # another needle: not the same prompts
    with pytest.raises(SmeltError, match="different prompts"):
        needle_paired.compare(_grid(ref)["languages"]["en"]["prompts"], shifted["languages"]["en"]["prompts"])
    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "paired.json"
    a.write_text(json.dumps(_grid(ref)))
    b.write_text(json.dumps(_grid(other)))
    ok = subprocess.run([sys.executable, "-m", "smelt", "needle-paired", "--out", str(out), f"ref={a}", f"x={b}"],
                        cwd=ROOT, capture_output=True, text=True, check=False)
    assert ok.returncode == 0 and json.loads(out.read_text())["against"]["x"]["all"]["lost"] == 3
    bad = subprocess.run([sys.executable, "-m", "smelt", "needle-paired", "--out", str(tmp_path / "no.json"), f"ref={a}"],
                         cwd=ROOT, capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and bad.stderr.strip() == "error: grids: give at least two LABEL=needle.json"
    assert not (tmp_path / "no.json").exists()
    empty = tmp_path / "empty.json"
    empty.write_text("{}")
    none = subprocess.run([sys.executable, "-m", "smelt", "needle-paired", "--out", str(tmp_path / "no.json"), f"ref={a}",
                           f"x={empty}"], cwd=ROOT, capture_output=True, text=True, check=False)
    assert none.returncode == 2 and none.stderr.strip() == f"error: grids: {empty} holds no needle prompts (write it with eval.needle --out)"
    assert not (tmp_path / "no.json").exists()
