"""eval.kl_tail (smelt kl-tail): which tokens make a KL tail (copyable bigrams, window positions, teacher certainty, overlap)."""
from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import torch

from eval import kl_tail

ROOT = Path(__file__).resolve().parents[1]


def test_a_bigram_seen_earlier_in_its_window_is_copyable_and_not_across_windows():
    w = torch.tensor([[1, 5, 6, 7, 5, 6, 8], [1, 6, 8, 2, 2, 2, 2]])
    # window 0: (5, 6) again at position 4; window 1: (6, 8) was only in window 0, (2, 2) repeats from position 4
    expect = [[0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 1, 1]]
    assert kl_tail.copyable(w).tolist() == [bool(x) for row in expect for x in row]


def test_the_tail_is_described_against_all_tokens():
    n = 1000
    kl = torch.linspace(0.0, 1.0, n)  # the top 10 tokens (>= P99) are the last ten
    pos = torch.arange(n) % 500  # the last ten sit at positions 490-499: the last band
    maxp = torch.full((n,), 0.2)
    maxp[-5:] = 0.9  # the teacher sure of half the tail, of 0.5% of all tokens
    agree = torch.ones(n, dtype=torch.bool)
    agree[-10:] = False
    copy = torch.zeros(n, dtype=torch.bool)
    copy[:100] = True
    r = kl_tail.anatomy(kl, pos, maxp, agree, copy)
    assert r["tail_tokens"] == 10 and math.isclose(r["threshold"], torch.quantile(kl.double(), 0.99).item())
    assert math.isclose(r["tail_mass_share"], kl[-10:].double().sum().item() / kl.double().sum().item())
    assert r["teacher_confident"] == {"all": 0.005, "tail": 0.5}
    assert r["top1_disagree"] == {"all": 0.01, "tail": 1.0}
    assert r["copyable"]["all"] == 0.1 and r["copyable"]["tail"] == 0.0
    bands = {tuple(b["positions"]): b for b in r["bands"]}
    assert bands[(256, 500)]["tail_share"] == 1.0 and bands[(0, 16)]["tail_share"] == 0.0
    assert math.isclose(sum(b["token_share"] for b in r["bands"]), 1.0)


def test_overlap_is_the_share_of_the_other_models_tail():
    first = torch.tensor([1, 1, 0, 0], dtype=torch.bool)
    other = torch.tensor([0, 1, 1, 1], dtype=torch.bool)
    assert math.isclose(kl_tail.tail_overlap(first, other), 1 / 3)
    assert kl_tail.tail_overlap(first, first) == 1.0


def test_a_folder_without_weights_is_refused(tmp_path):
    r = subprocess.run([sys.executable, "-m", "eval.kl_tail", tmp_path, "--out", tmp_path / "x"], check=False, capture_output=True,
                       text=True, cwd=ROOT)
    assert r.returncode != 0 and "no model.safetensors" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not list(tmp_path.glob("x*"))
