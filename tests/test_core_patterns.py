"""The N:M pattern type: parsed and validated once, where a setting enters."""
from __future__ import annotations

import pytest
import torch

from core.errors import SmeltError
from core.patterns import NMPattern


def test_parse_validate_and_print():
    p = NMPattern.parse(" 2 : 4 ")
    assert p == NMPattern(2, 4) and str(p) == "2:4" and p.sparsity == 0.5
    with pytest.raises(SmeltError, match="--pattern"):
        NMPattern.parse("2/4")
    with pytest.raises(SmeltError, match="settings.pattern"):
        NMPattern.parse("x", field="settings.pattern")
    for n, m in ((4, 4), (0, 4), (True, 4)):
        with pytest.raises(SmeltError):
            NMPattern(n, m)
    with pytest.raises(SmeltError, match="layers.0.attention.wq"):
        NMPattern(2, 4).check_fits(62, "layers.0.attention.wq")


def test_keep_top_and_holds():
    p = NMPattern(2, 4)
    score = torch.tensor([[1.0, 4.0, 3.0, 2.0, 0.0, 0.0, 5.0, 5.0]])
    keep = p.keep_top(score)
    assert keep.tolist() == [[False, True, True, False, False, False, True, True]]
    assert p.holds(keep) and p.holds(score * keep)
    assert not p.holds(torch.ones(1, 8)) and not p.holds(torch.ones(1, 6))  # 6 is no multiple of 4
