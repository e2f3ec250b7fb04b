"""Depth removal: block influence and angular distance from the model's own forward, the choice with
protected layers kept, and a smaller model that loads."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, tiny_config

from core.data import calibration_windows
from core.errors import SmeltError
from models.hf_io import load_hf
from models.llama import build_model
from prune.depth import choose, depth_scores, drop_kl


def test_an_identity_block_has_zero_influence_and_is_the_one_removed(byte_tokenizer):
    model = build_model(tiny_config("debug-untied", max_seq_len=128), seed=0).eval()  # 3 layers
    with torch.no_grad():  # block 1 adds nothing to the residual stream: cos(x_in, x_out) = 1
        model.layers["1"].attention.wo.weight.zero_()
        model.layers["1"].feed_forward.w2.weight.zero_()
    s = depth_scores(model, calibration_windows(byte_tokenizer, 4, 32), 1)
    assert s["influence"][1] == pytest.approx(0, abs=1e-6) and min(s["influence"][0], s["influence"][2]) > 1e-3
    assert s["angular"][1] == pytest.approx(0, abs=1e-3)
    assert choose(s, 1, "angular", set()) == [1] and choose(s, 1, "influence", set()) == [1]
    assert choose(s, 1, "influence", {1}) != [1]  # protected: kept
    assert choose(s, 1, "influence", {1}, penalty=0.0) == [1]  # a soft rule that costs nothing


def test_drop_kl_is_zero_for_an_identity_block_and_ranks_the_kl_method(byte_tokenizer):
    model = build_model(tiny_config("debug-untied", max_seq_len=128), seed=0).eval()
    with torch.no_grad():
        model.layers["2"].attention.wo.weight.zero_()
        model.layers["2"].feed_forward.w2.weight.zero_()
    before = model(torch.tensor([[1, 5, 9]]))
    kl = drop_kl(model, calibration_windows(byte_tokenizer, 3, 32))
    assert kl[2] == pytest.approx(0, abs=1e-7) and min(kl[:2]) > 1e-4
    assert torch.equal(model(torch.tensor([[1, 5, 9]])), before)  # the hooks are gone
    assert choose({"influence": [0.0, 0.1, 0.2], "kl": kl}, 1, "kl", set()) == [2]


def test_protection_that_covers_every_choice_and_too_many_layers_are_one_line(byte_tokenizer):
    s = {"influence": [0.1, 0.2, 0.3], "angular": [0.1, 0.2]}
    with pytest.raises(SmeltError, match="every run of 2 contiguous layers holds a protected head"):
        choose(s, 2, "angular", {1})
    with pytest.raises(SmeltError, match="only 1 layers hold no protected head"):
        choose(s, 2, "influence", {0, 1})
    model = build_model(tiny_config(max_seq_len=128), seed=0).eval()
    with pytest.raises(SmeltError, match="--remove 2: the model has 2 layers"):
        depth_scores(model, calibration_windows(byte_tokenizer, 2, 32), 2)


def test_cli_writes_a_smaller_model_that_loads_and_says_what_it_removed(tmp_path, tiny_model_dir):
    heads = tmp_path / "heads.json"
    heads.write_text(json.dumps({"protected": [{"layer": "0", "head": 1, "why": ["sink"]}]}))
    out = tmp_path / "short"
    cmd = [sys.executable, "-m", "prune.depth", "--teacher", str(tiny_model_dir), "--remove", "1",
           "--heads", str(heads), "--calib-windows", "2", "--calib-seq-len", "32", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    small = load_hf(out)
    assert len(small.layers) == 1 and json.loads((out / "config.json").read_text())["num_hidden_layers"] == 1
    m = json.loads((out / "manifest.json").read_text())
    assert m["metrics"]["removed_layers"] == [1] and m["metrics"]["protected_layers"] == [0]
    assert len(m["metrics"]["scores"]["kl"]) == 2 and min(m["metrics"]["scores"]["kl"]) > 0
    assert json.loads((out / "protected.json").read_text())["protected"] == [{"layer": "0", "head": 1}]
    bad_cmd = [a if a != "1" else "2" for a in cmd[:-1]] + [str(tmp_path / "x")]  # --remove 2 of 2 layers
    bad = subprocess.run(bad_cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert bad.returncode == 2 and "--remove 2: the model has 2 layers" in bad.stderr
    assert not (tmp_path / "x").exists()
