"""eval.chain_seeds (smelt chain-seeds): whole chains grouped by setting, each setting's seed scatter."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from core.errors import SmeltError
from eval import chain_seeds

ROOT = Path(__file__).resolve().parents[1]


def _chain(tmp_path: Path, name: str, kl_en: float, needles: float, buckets=("en", "zh", "code", "news")) -> str:
    ev = {"buckets": {b: {"kl_mean": kl_en + i, "kl_p99": 4.0 + i, "ppl": 40.0 + i} for i, b in enumerate(buckets)}}
    grid = {"languages": {"en": {"accuracy": needles, "by_length": {"2048": needles / 2},
                                 "prompts": [{"correct": True}] * 4}}}
    (tmp_path / f"{name}.eval.json").write_text(json.dumps(ev))
    (tmp_path / f"{name}.needle.json").write_text(json.dumps(grid))
    return f"{name}:{tmp_path / f'{name}.eval.json'}:{tmp_path / f'{name}.needle.json'}"


def test_each_setting_gets_every_chain_and_its_mean_and_range(tmp_path):
    a = ",".join([_chain(tmp_path, "a0", 0.70, 0.97), _chain(tmp_path, "a1", 0.72, 0.88)])
    b = _chain(tmp_path, "b0", 0.71, 0.76)
    subprocess.run([sys.executable, "-m", "smelt", "chain-seeds", "--out", str(tmp_path / "s"),
                    f"default={a}", f"fast={b}"], check=True, cwd=ROOT)
    out = json.loads((tmp_path / "s.json").read_text())
    m = out["settings"]["default"]["summary"]
    assert m["kl_mean_en"]["mean"] == pytest.approx(0.71) and m["kl_mean_zh"]["min"] == pytest.approx(1.70)
    assert (m["needles_all"]["min"], m["needles_all"]["max"]) == (0.88, 0.97)
    assert out["settings"]["fast"]["chains"]["b0"]["needles_2048"] == pytest.approx(0.38)
    assert (tmp_path / "s.png").stat().st_size > 0


def test_a_chain_without_a_bucket_or_a_needle_grid_is_refused(tmp_path):
    with pytest.raises(SmeltError, match="no bucket 'news'"):
        chain_seeds.parse_setting("x=" + _chain(tmp_path, "c", 0.7, 0.9, buckets=("en", "zh", "code")))
    with pytest.raises(SmeltError, match="not NAME:EVAL:NEEDLE"):
        chain_seeds.parse_setting("x=c:only-two")
    (tmp_path / "empty.json").write_text("{}")
    spec = _chain(tmp_path, "d", 0.7, 0.9).rsplit(":", 1)[0] + f":{tmp_path / 'empty.json'}"
    with pytest.raises(SmeltError, match="no English needle grid"):
        chain_seeds.parse_setting("x=" + spec)
