"""Layer-wise distillation: the per-token hidden-state distance, block pairing after depth removal, and the
trainer's hooks."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import launch_log, make_distill_dirs
from test_trainer import torchrun

from core.artifact import write_manifest
from core.errors import SmeltError
from distill.losses import DistillLossConfig, hidden_divergence, parse_layers
from models.hf_io import load_hf
from train.lineage import teacher_blocks


def test_hidden_divergence_is_scale_free_and_zero_at_the_teacher():
    t = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(hidden_divergence("nmse", t, t), torch.zeros(3, 5))
    assert torch.allclose(hidden_divergence("nmse", 2 * t, t), torch.ones(3, 5))  # ||t||^2 / ||t||^2
    assert torch.allclose(hidden_divergence("nmse", 200 * t, 100 * t), torch.ones(3, 5))
    assert torch.allclose(hidden_divergence("cosine", 3 * t, t), torch.zeros(3, 5), atol=1e-6)
    assert torch.allclose(hidden_divergence("cosine", -t, t), torch.full((3, 5), 2.0))
    assert parse_layers(" 3, 7 ,11") == ("3", "7", "11")
    for bad in ("3,3", "a,1", "-1"):
        with pytest.raises(SmeltError, match="loss.hidden_layers"):
            parse_layers(bad)
    with pytest.raises(SmeltError, match="hidden_weight"):
        DistillLossConfig(hidden_weight=1.0)  # no blocks named
    with pytest.raises(SmeltError, match="hidden_weight"):
        DistillLossConfig(hidden_layers="1")  # blocks named, no weight
    with pytest.raises(SmeltError, match="hidden_kind"):
        DistillLossConfig(hidden_kind="l1")


def test_blocks_pair_through_the_manifest_chain_of_depth_removals(tmp_path):
    a, b, c = (tmp_path / n for n in "abc")
    for d in (a, b, c):
        d.mkdir()
    write_manifest(a, "depth", {}, {"removed_layers": [1, 4]}, parent={"path": "teacher"})  # 8 -> 6
    write_manifest(b, "distill", {}, parent={"path": str(a)})
    write_manifest(c, "depth", {}, {"removed_layers": [0]}, parent={"path": str(b)})         # 6 -> 5
    assert teacher_blocks(a, 6, 8) == [0, 2, 3, 5, 6, 7]
    assert teacher_blocks(c, 5, 8) == [2, 3, 5, 6, 7]
    with pytest.raises(SmeltError, match="does not say which blocks"):
        teacher_blocks(b, 5, 8)  # the chain accounts for 6 blocks, not 8
    assert teacher_blocks(tmp_path / "none", 8, 8) == list(range(8))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return make_distill_dirs(tmp_path_factory.mktemp("layerwise"))


def _block_nmse(model, teacher, key: str) -> float:
    tokens = torch.randint(3, 260, (4, 32), generator=torch.Generator().manual_seed(5))
    out = {}
    for name, m in (("s", model), ("t", teacher)):
        h = m.layers[key].register_forward_hook(lambda mod, a, o, name=name: out.__setitem__(name, o))
        with torch.no_grad():
            m(tokens)
        h.remove()
    return hidden_divergence("nmse", out["s"], out["t"]).mean().item()


def test_the_trainer_adds_the_layerwise_loss_and_it_pulls_blocks_to_the_teacher(dirs):
    plain = torchrun(dirs, "plain", "--training.steps", "6")
    assert plain.returncode == 0, launch_log(plain)
    hidden = torchrun(dirs, "hidden", "--training.steps", "6", "--loss.hidden_weight", "20",
                      "--loss.hidden_layers", "0,1")
    assert hidden.returncode == 0, launch_log(hidden)
    settings = json.loads((dirs / "hidden-out" / "manifest.json").read_text())["settings"]["loss"]
    assert settings["hidden_weight"] == 20 and settings["hidden_layers"] == "0,1"
    teacher = load_hf(dirs / "teacher")
    for key in ("0", "1"):
        assert _block_nmse(load_hf(dirs / "hidden-out"), teacher, key) < _block_nmse(
            load_hf(dirs / "plain-out"), teacher, key)
    bad = torchrun(dirs, "bad", "--training.steps", "2", "--loss.hidden_weight", "1", "--loss.hidden_layers", "5")
    assert bad.returncode != 0 and "teacher block 5 is not in the student" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and not (dirs / "bad-out").exists()
