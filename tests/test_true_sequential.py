"""True-sequential calibration (core.true_sequential): every linear's statistics equal brute force on the final
changed model, in one forward pass per block; on_block per group in execution order; errors unwind every parked batch."""
from __future__ import annotations

import copy
import gc

import pytest
import torch
from conftest import tiny_config
from greenlet import getcurrent, greenlet
from test_prune_pipeline import EXACT, PROBE, captured_inputs, collect

from core.calibrate import CalibConfig, bf16_is_fast, run_blocks
from core.errors import SmeltError
from models.llama import build_model


def _parked_batches():
    """Batch forwards still suspended somewhere (greenlets neither finished nor unwound)."""
    gc.collect()
    return [g for g in gc.get_objects() if type(g) is greenlet and not g.dead and g is not getcurrent()]


def _windows(n=5, seq=16, seed=0):
    return torch.randint(0, 260, (n, seq), generator=torch.Generator().manual_seed(seed))


def test_each_linear_sees_its_inputs_through_the_groups_already_changed():
    """A linear's input depends only on the weights before it, so in the final (all pruned) model every linear's
    input is the one true-sequential calibration must have seen: brute force on it equals the stats."""
    dense = build_model(tiny_config("debug-untied", max_seq_len=64), seed=3).eval()
    windows = _windows()
    model = copy.deepcopy(dense)
    cfg = CalibConfig(n_windows=5, seq_len=16, batch_size=2, true_sequential=True, **EXACT)  # batches 2, 2, 1
    order = []
    got = {}

    def on_block(block_name, block, stats):
        order.append(sorted(n.removeprefix(block_name + ".") for n in stats))
        got.update({k: (v.H.clone(), v.n_tokens) for k, v in stats.items()})
        for k in stats:
            lin = block.get_submodule(k.removeprefix(block_name + "."))
            lin.weight.copy_(lin.weight * (lin.weight.abs() > lin.weight.abs().median()))
    done = []
    run_blocks(model, windows, on_block, cfg, progress=False, block_done=done.append)
    groups = [["attention.wk", "attention.wq", "attention.wv"], ["attention.wo"],
              ["feed_forward.w1", "feed_forward.w3"], ["feed_forward.w2"]]
    assert order == groups * len(model.layers)
    assert done == [f"layers.{k}" for k in model.layers]
    assert not _parked_batches()  # every batch's forward finished or unwound
    for name, (H, n_tokens) in got.items():
        X = captured_inputs(model, windows, name)
        assert n_tokens == 5 * 16
        assert torch.allclose(H, X.T @ X, rtol=1e-5, atol=1e-6 * float(X.abs().max()) ** 2), name
    # The block-at-a-time order differs exactly where a group runs after a changed one (wo, w2 in block 0).
    plain = collect(copy.deepcopy(dense), windows, CalibConfig(n_windows=5, seq_len=16, batch_size=2, **EXACT), 0.5)
    for name, same in (("layers.0.attention.wq", True), ("layers.0.attention.wo", False), (f"layers.0.{PROBE}", False)):
        assert torch.allclose(plain["layers.0"][name][0], got[name][0], rtol=1e-6) == same, name


@pytest.mark.skipif(not bf16_is_fast(torch.device("cpu")), reason="bf16 forwards need AMX / avx512-bf16")
def test_bf16_forwards_run_each_group_with_its_changed_weights():
    """The algorithms change the fp32 block; the bf16 copy the forwards run must follow group by group."""
    model = build_model(tiny_config(max_seq_len=64), seed=4).eval()
    H = {}

    def on_block(block_name, block, stats):  # zero each group: inputs computed through it must be zeros
        for k, st in stats.items():
            H[k] = st.H.clone()
            block.get_submodule(k.removeprefix(block_name + ".")).weight.detach().zero_()
    run_blocks(model, _windows(4, 32, 1), on_block,
               CalibConfig(n_windows=4, seq_len=32, forward="bfloat16", true_sequential=True), progress=False)
    for key in model.layers:
        zero_v = float(H[f"layers.{key}.attention.wo"].abs().max())  # attention over v = 0
        zero_w13 = float(H[f"layers.{key}.{PROBE}"].abs().max())  # silu(0) * 0
        assert zero_v == 0 and zero_w13 == 0
        assert float(H[f"layers.{key}.feed_forward.w1"].abs().max()) > 0  # the residual stream still flows


@pytest.mark.parametrize("where", ["change", "forward"])
def test_an_error_while_changing_a_group_or_in_a_batch_unwinds_every_batch(where):
    model = build_model(tiny_config(max_seq_len=64), seed=5).eval()
    calls = []

    def on_block(block_name, block, stats):
        calls.append(sorted(stats))
        if where == "change" and len(calls) == 2:
            raise SmeltError("layers.0.attention.wo: refused")
    seen = []

    def fail_third_batch(module, args):  # a batch's forward failing past a parked group
        seen.append(1)
        if len(seen) == 3:
            raise RuntimeError("batch 2 failed in w2")
    if where == "forward":
        model.layers["0"].feed_forward.w2.register_forward_pre_hook(fail_third_batch)
    with pytest.raises((SmeltError, RuntimeError), match="wo: refused" if where == "change" else "batch 2 failed"):
        run_blocks(model, _windows(6, 16), on_block,
                   CalibConfig(n_windows=6, seq_len=16, batch_size=1, true_sequential=True), progress=False)
    assert len(calls) == (2 if where == "change" else 3)  # the batch fails on its way to w2's change
    assert not _parked_batches()


def test_settings_that_cannot_go_together_are_refused():
    with pytest.raises(SmeltError, match="true_sequential=true needs sequential=true"):
        CalibConfig(sequential=False, true_sequential=True)
    with pytest.raises(SmeltError, match="true_sequential='yes' must be true or false"):
        CalibConfig(true_sequential="yes")
    model = build_model(tiny_config(max_seq_len=64), seed=5).eval()
    with pytest.raises(SmeltError, match="teacher targets .* without true_sequential"):
        run_blocks(model, _windows(2, 16), lambda *a: None, CalibConfig(n_windows=2, seq_len=16, true_sequential=True),
                   progress=False, teacher_targets=True)
