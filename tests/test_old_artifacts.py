"""Artifacts written before the ground-floor move (tests/fixtures/v0-artifacts, made by smelt f5246a0 with
its own code) still load, keep their masks and scales, and still release and verify."""
from __future__ import annotations

import torch

from conftest import ROOT
from core.masks import load_masks
from models.hf_io import load_hf
from qat.qparams import read_qparams
from qat.release import build_release
from qat.verify import verify_release

V0 = ROOT / "tests" / "fixtures" / "v0-artifacts"


def test_v0_artifacts_load_with_their_masks_and_scales(tmp_path):
    for name in ("teacher", "pruned-2of4", "rtn-2of4"):
        model = load_hf(V0 / name)
        assert torch.isfinite(model(torch.tensor([[1, 5, 9, 200]]))).all()
    pruned = load_hf(V0 / "pruned-2of4")
    masks = load_masks(V0 / "pruned-2of4")
    assert len(masks) == 7 and all(m.dtype == torch.bool for m in masks.values())
    modules = dict(pruned.named_modules())
    for name, keep in masks.items():
        w = modules[name].weight
        assert keep.shape == w.shape and bool((w[~keep] == 0).all()) and int(keep.sum()) * 2 == keep.numel()
    qparams, spec = read_qparams(V0 / "rtn-2of4")
    assert (spec.bits, spec.symmetric, spec.group_size) == (4, True, 16)
    assert set(qparams) == set(masks) and all(zp is None for _, zp in qparams.values())


def test_a_v0_quantized_artifact_still_releases_and_verifies(tmp_path):
    out = build_release(V0 / "rtn-2of4", tmp_path / "release")
    report = verify_release(out)
    assert not report.failures, report.lines
