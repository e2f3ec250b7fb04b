"""eval.mask_agreement and eval.seed_spread --reference (smelt mask-agreement, smelt seed-spread): how far two
pruned artifacts' masks are apart, and a setting's seed-by-seed difference from a reference (a numerics change
read against a calibration draw)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from core.errors import SmeltError
from eval import mask_agreement, seed_spread

ROOT = Path(__file__).resolve().parents[1]


def _two_of_four(rows: int, groups: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    keep = torch.zeros(rows, groups, 4, dtype=torch.bool)
    top = torch.rand(rows, groups, 4, generator=g).topk(2, dim=-1).indices
    return keep.scatter(-1, top, True).reshape(rows, groups * 4)


def test_group_changes_counts_groups_not_entries():
    a = _two_of_four(8, 16, 0)
    b = a.clone()
    b[0, :4] = torch.tensor([True, True, False, False])  # one group, possibly unchanged
    b[3, 8:12] = ~a[3, 8:12]  # another group: all four entries flip
    changed, total = mask_agreement.group_changes(a, b)
    assert total == 8 * 16
    assert changed == 1 + int(not torch.equal(a[0, :4], b[0, :4]))
    assert mask_agreement.group_changes(a, a) == (0, 128)
    with pytest.raises(SmeltError, match="shapes differ"):
        mask_agreement.group_changes(a, a[:4])


def test_compare_per_block(monkeypatch, tmp_path):
    base = {f"layers.{i}.mlp.up": _two_of_four(4, 8, i) for i in range(3)}
    other = {k: v.clone() for k, v in base.items()}
    other["layers.2.mlp.up"] = ~other["layers.2.mlp.up"]  # every group of block 2
    masks = {"a": base, "b": other, "c": {}}
    monkeypatch.setattr(mask_agreement, "load_masks", lambda d: masks[Path(d).name])
    r = mask_agreement.compare(Path("a"), Path("b"))
    assert r["per_block"] == {0: 0.0, 1: 0.0, 2: 1.0} and r["changed_share"] == pytest.approx(1 / 3, abs=1e-6)
    with pytest.raises(SmeltError, match="same linears"):
        mask_agreement.compare(Path("a"), Path("c"))
    bad = subprocess.run([sys.executable, "-m", "smelt", "mask-agreement", "--out", str(tmp_path / "x.json"), "nolabel"],
                         cwd=ROOT, capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and bad.stderr.strip() == "error: pairs: 'nolabel' is not LABEL:RUN_A=RUN_B"
    assert not (tmp_path / "x.json").exists()


def _manifest(path: Path, seed: int, ppl: float) -> Path:
    ev = {"en": {"kl_mean": 1.0, "kl_p99": 5.0, "ppl": ppl}}
    path.write_text(json.dumps({"settings": {"calibration": {"seed": seed}}, "metrics": {"eval": {"buckets": ev}}}))
    return path


def test_paired_difference_against_the_reference(tmp_path):
    ref = seed_spread.spread([_manifest(tmp_path / f"r{s}.json", s, p) for s, p in ((0, 100), (1, 110), (2, 90))])
    fast = seed_spread.spread([_manifest(tmp_path / f"f{s}.json", s, p) for s, p in ((0, 102), (1, 111), (2, 93))])
    d = seed_spread.paired(fast, ref)["en"]["ppl"]
    assert d["n"] == 3 and d["diff_pct"] == pytest.approx(2.0)  # (2 + 1 + 3) / 3 of the reference's mean 100
    assert d["se_pct"] == pytest.approx(1.0 / 3 ** 0.5, abs=0.01)  # sd of (2, 1, 3) is 1
    assert d["reference_sd_pct"] == pytest.approx(10.0)
    assert seed_spread.paired(fast, ref)["en"]["kl_mean"]["diff_pct"] == 0
    out = subprocess.run([sys.executable, "-m", "smelt", "seed-spread", "--out", str(tmp_path / "s"), "--reference",
                          "nope", f"ref={tmp_path / 'r0.json'}"], cwd=ROOT, capture_output=True, text=True, check=False)
    assert out.returncode == 2 and "--reference 'nope' is none of the settings' labels (ref)" in out.stderr
    assert not (tmp_path / "s").exists()
