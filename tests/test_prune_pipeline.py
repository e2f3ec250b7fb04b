"""Calibration engine and pruning driver: statistics vs brute force, sequential calibration, masks,
the CLI artifact, and bad input (one-line error, exit 2, nothing written)."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, tiny_config
from torch import nn

from core.calibrate import CalibConfig, bf16_is_fast, run_blocks
from core.errors import SmeltError, run_cli
from core.masks import load_dense_rows, load_masks
from core.patterns import NMPattern
from core.protected import dense_rows
from models.hf_io import load_hf
from models.llama import DEFAULT_SKIP, build_model, linear_names
from prune.algorithms import magnitude_prune, reconstruction_error
from prune.run import main, prune_model, prune_targets

PROBE = "feed_forward.w2"  # its input (silu(w1 x) * w3 x) exists only inside the block
EXACT = {"forward": "float32", "hessian": "float64"}  # the reference precision (brute-force comparisons)


@torch.no_grad()
def captured_inputs(model: nn.Module, windows: torch.Tensor, name: str) -> torch.Tensor:
    """Brute force: one full-model forward, recording the inputs of linear `name` as [tokens, in]."""
    seen = []
    handle = dict(model.named_modules())[name].register_forward_hook(lambda m, a, o: seen.append(a[0]))
    model(windows)
    handle.remove()
    return torch.cat(seen).reshape(-1, seen[0].shape[-1]).double()


def collect(model, windows, cfg, prune_fraction=0.0, targets=None):
    """run_blocks with an on_block that records copies of the stats and optionally magnitude-prunes."""
    got = {}

    def on_block(block_name, block, stats):
        got[block_name] = {k: (v.H.clone(), v.act_norm.clone(), v.n_tokens, v) for k, v in stats.items()}
        for k in stats if prune_fraction else ():
            lin = block.get_submodule(k.removeprefix(block_name + "."))
            lin.weight.copy_(magnitude_prune(lin.weight, prune_fraction)[0])

    run_blocks(model, windows, on_block, cfg, targets=targets, progress=False)
    return got


def test_stats_match_brute_force_with_noncontiguous_layers():
    model = build_model(tiny_config("debug-untied", max_seq_len=64), seed=3).eval()
    del model.layers["1"]  # depth-pruned: keys "0", "2"
    windows = torch.randint(0, 260, (5, 16), generator=torch.Generator().manual_seed(0))
    cfg = CalibConfig(n_windows=5, seq_len=16, batch_size=2, **EXACT)  # batches of 2, 2, 1
    got = collect(model, windows, cfg)
    assert list(got) == ["layers.0", "layers.2"]
    for name in ("layers.2.feed_forward.w2", "layers.2.attention.wq", "layers.0.attention.wo"):
        X = captured_inputs(model, windows, name)
        H, act_norm, n_tokens, _ = got[name.rsplit(".", 2)[0]][name]
        assert n_tokens == 5 * 16
        assert torch.allclose(H, X.T @ X, rtol=1e-5, atol=1e-6 * float(X.abs().max()) ** 2)
        assert torch.allclose(act_norm, X.norm(dim=0), rtol=1e-5)
    # wq/wk/wv read the same tensor: one shared statistics object, each token counted once
    block = got["layers.2"]
    assert block["layers.2.attention.wq"][3] is block["layers.2.attention.wv"][3]
    assert block["layers.2.feed_forward.w1"][3] is not block["layers.2.feed_forward.w2"][3]
    only = collect(model, windows, cfg, targets=lambda n: n.endswith(PROBE))
    assert {k for b in only.values() for k in b} == {"layers.0.feed_forward.w2", "layers.2.feed_forward.w2"}


def test_sequential_calibration_sees_the_pruned_previous_block():
    dense = build_model(tiny_config(max_seq_len=64), seed=4).eval()
    windows = torch.randint(0, 260, (4, 32), generator=torch.Generator().manual_seed(1))
    seq_model, par_model = copy.deepcopy(dense), copy.deepcopy(dense)
    seq = collect(seq_model, windows, CalibConfig(n_windows=4, seq_len=32, batch_size=3, **EXACT), 0.5)
    par = collect(par_model, windows, CalibConfig(n_windows=4, seq_len=32, batch_size=3, sequential=False, **EXACT),
                  0.5)
    probe0, probe1 = f"layers.0.{PROBE}", f"layers.1.{PROBE}"
    assert torch.equal(seq["layers.0"][probe0][0], par["layers.0"][probe0][0])  # same dense inputs
    H_seq, H_par = seq["layers.1"][probe1][0], par["layers.1"][probe1][0]
    assert not torch.allclose(H_seq, H_par, rtol=1e-3)
    # sequential block 1 = inputs through pruned block 0; non-sequential = the dense model's inputs
    half = copy.deepcopy(dense)
    half.layers["0"].load_state_dict(seq_model.layers["0"].state_dict())
    for H, reference in ((H_seq, half), (H_par, dense)):
        X = captured_inputs(reference, windows, probe1)
        assert torch.allclose(H, X.T @ X, rtol=1e-5, atol=1e-6 * float(X.abs().max()) ** 2)


def test_teacher_targets_pair_the_teachers_inputs_with_the_pruned_models_token_for_token():
    """C = X_dᵀX: X_d from the dense model, X through the pruned block 0 (brute force on both models); H and
    every other statistic as without teacher targets; the teacher stream costs no statistics of its own."""
    dense = build_model(tiny_config(max_seq_len=64), seed=4).eval()
    windows = torch.randint(0, 260, (4, 32), generator=torch.Generator().manual_seed(1))
    cfg = CalibConfig(n_windows=4, seq_len=32, batch_size=3, **EXACT)  # batches of 3 and 1
    plain_model, model = copy.deepcopy(dense), copy.deepcopy(dense)
    plain = collect(plain_model, windows, cfg, 0.5)
    got = {}

    def on_block(block_name, block, stats):
        got[block_name] = {k: (v.H.clone(), v.C.clone(), v.n_tokens) for k, v in stats.items()}
        for k in stats:
            lin = block.get_submodule(k.removeprefix(block_name + "."))
            lin.weight.copy_(magnitude_prune(lin.weight, 0.5)[0])

    run_blocks(model, windows, on_block, cfg, progress=False, teacher_targets=True)
    for name in (f"layers.0.{PROBE}", "layers.0.attention.wq"):  # block 0: both streams are the teacher's
        H, C, n = got["layers.0"][name]
        assert n == 4 * 32 and torch.allclose(C, H, rtol=1e-6, atol=1e-8)
    half = copy.deepcopy(dense)
    half.layers["0"].load_state_dict(model.layers["0"].state_dict())
    for name in (f"layers.1.{PROBE}", "layers.1.attention.wv"):
        H, C, n = got["layers.1"][name]
        X, Xd = captured_inputs(half, windows, name), captured_inputs(dense, windows, name)
        scale = float(X.abs().max()) * float(Xd.abs().max())
        assert torch.allclose(C, Xd.T @ X, rtol=1e-5, atol=1e-6 * scale)
        assert not torch.allclose(C, H, rtol=1e-3)  # block 0 was pruned: the streams differ now
        assert torch.equal(H, plain["layers.1"][name][0]) and n == 4 * 32
    with pytest.raises(SmeltError, match="teacher targets need sequential"):
        run_blocks(copy.deepcopy(dense), windows, on_block, CalibConfig(n_windows=4, seq_len=32, sequential=False),
                   progress=False, teacher_targets=True)


def test_float32_hessian_matches_float64_and_stays_honest_about_its_precision():
    model = build_model(tiny_config(max_seq_len=64), seed=5).eval()
    windows = torch.randint(0, 260, (6, 32), generator=torch.Generator().manual_seed(2))
    ref = collect(copy.deepcopy(model), windows, CalibConfig(n_windows=6, seq_len=32, batch_size=2, **EXACT))
    got = collect(copy.deepcopy(model), windows, CalibConfig(n_windows=6, seq_len=32, batch_size=2, forward="float32",
                                                             hessian="float32"))
    for block, stats in ref.items():
        for name, (H, act_norm, n, _) in stats.items():
            H32 = got[block][name][0]
            assert H32.dtype == torch.float32 and got[block][name][2] == n  # handed out in its products' precision
            assert torch.allclose(H32.double(), H, rtol=1e-5, atol=1e-6 * float(H.abs().max()))
            assert torch.allclose(got[block][name][1], act_norm, rtol=1e-6)
    coarse = collect(copy.deepcopy(model), windows, CalibConfig(n_windows=6, seq_len=32, batch_size=2,
                                                                forward="float32", hessian="bfloat16"))
    for block, stats in ref.items():
        for name, (H, _, _, _) in stats.items():
            Hb = coarse[block][name][0]
            assert Hb.dtype == torch.float32  # the fp64 sum of bf16 products, not rounded to bf16 again
            assert float((Hb.double() - H).norm() / H.norm()) < 1e-2
    cpu = torch.device("cpu")
    CalibConfig(hessian="bfloat16").check_dampening(0.01, cpu)
    CalibConfig(hessian="float32").check_dampening(0.0, cpu)  # fp32's epsilon: the rank test judges it
    with pytest.raises(SmeltError, match="hessian=bfloat16 needs percdamp > 0"):
        CalibConfig(hessian="bfloat16").check_dampening(0.0, cpu)


def test_bf16_forwards_keep_fp32_blocks_and_feed_the_modified_weights_on():
    model = build_model(tiny_config(max_seq_len=64), seed=6).eval()
    windows = torch.randint(0, 260, (4, 32), generator=torch.Generator().manual_seed(3))
    cfg = CalibConfig(n_windows=4, seq_len=32, batch_size=2, forward="bfloat16")
    if not bf16_is_fast(torch.device("cpu")):
        with pytest.raises(SmeltError, match="forward=bfloat16: cpu has no bf16 matmul units"):
            cfg.forward_dtype(torch.device("cpu"))
        assert CalibConfig(forward="auto").forward_dtype(torch.device("cpu")) == torch.float32
        return
    assert CalibConfig(forward="auto").forward_dtype(torch.device("cpu")) == torch.bfloat16
    ref_model, bf_model = copy.deepcopy(model), copy.deepcopy(model)
    ref = collect(ref_model, windows, CalibConfig(n_windows=4, seq_len=32, batch_size=2, **EXACT), 0.5)
    got = collect(bf_model, windows, cfg, 0.5)
    assert all(p.dtype == torch.float32 for p in bf_model.parameters())  # the algorithms' weights stay fp32
    for block, stats in ref.items():
        for name, (H, act_norm, _, _) in stats.items():
            rel = (got[block][name][0] - H).norm() / H.norm()
            assert rel < 0.03, (name, float(rel))  # bf16 activations: ~2^-8 relative per entry
    # block 1 saw block 0 as pruned: its statistics follow the pruned model's activations, not the dense one's
    dense = collect(copy.deepcopy(model), windows, CalibConfig(n_windows=4, seq_len=32, batch_size=2, **EXACT))
    probe = f"layers.1.{PROBE}"
    far = (got["layers.1"][probe][0] - dense["layers.1"][probe][0]).norm()
    near = (got["layers.1"][probe][0] - ref["layers.1"][probe][0]).norm()
    assert near < far / 3
    with pytest.raises(SmeltError, match="calibration forward='fp8' is not one of"):
        CalibConfig(forward="fp8")
    with pytest.raises(SmeltError, match="calibration hessian='float16' is not one of"):
        CalibConfig(hessian="float16")


@pytest.fixture
def calib(byte_tokenizer):
    cfg = CalibConfig(n_windows=4, seq_len=64, batch_size=2, **EXACT)
    return cfg, cfg.windows(byte_tokenizer)


def test_sparsegpt_2of4_masks_zeros_and_skipped_modules(tiny_model_dir, calib):
    cfg, windows = calib
    model = load_hf(tiny_model_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    masks, report = prune_model(model, windows, "sparsegpt", pattern=NMPattern(2, 4), cfg=cfg, progress=False)
    assert sorted(masks) == sorted(linear_names(model))
    mods = dict(model.named_modules())
    for name, keep in masks.items():
        W = mods[name].weight
        assert NMPattern(2, 4).holds(keep) and int(keep.sum()) == keep.numel() // 2
        assert bool((W[~keep] == 0).all()) and NMPattern(2, 4).holds(W)
        assert 0 < report["per_module"][name]["rel_recon_error"] < 1
    for name in ("tok_embeddings.weight", "output.weight", "norm.weight", "layers.1.ffn_norm.weight"):
        assert torch.equal(model.state_dict()[name], before[name])
    assert report["sparsity"] == 0.5 and report["pattern"] == "2:4"
    assert set(report["timings_s"]) >= {"forward_s", "stats_s", "hessian_inverse_s", "prune_update_s"}
    # the H-trace error equals the brute-force one for block 0 (its inputs do not depend on pruning)
    dense = load_hf(tiny_model_dir)
    X = captured_inputs(dense, windows, "layers.0.attention.wq")
    brute = reconstruction_error(X, before["layers.0.attention.wq.weight"], mods["layers.0.attention.wq"].weight,
                                 relative=True)
    assert report["per_module"]["layers.0.attention.wq"]["rel_recon_error"] == pytest.approx(brute, rel=1e-4)


@pytest.mark.parametrize("method", ["sparsegpt", "wanda"])
def test_refit_keeps_the_masks_and_lowers_every_layer_error(tiny_model_dir, calib, method):
    """--refit changes weights, never masks: same 2:4 masks as without it (the first block's, whose inputs
    do not depend on pruning; later blocks see refitted inputs), and a lower layer-wise error everywhere."""
    cfg, windows = calib
    plain, fitted = load_hf(tiny_model_dir), load_hf(tiny_model_dir)
    masks_p, rep_p = prune_model(plain, windows, method, pattern=NMPattern(2, 4), cfg=cfg, progress=False,
                                 dense_rows={"layers.0.attention.wq": torch.arange(64) < 16})
    masks, rep = prune_model(fitted, windows, method, pattern=NMPattern(2, 4), cfg=cfg, progress=False, refit="layer",
                             dense_rows={"layers.0.attention.wq": torch.arange(64) < 16})
    mods = dict(fitted.named_modules())
    for name, keep in masks.items():
        if name.startswith("layers.0."):
            assert torch.equal(keep, masks_p[name]), name
        assert bool((mods[name].weight[~keep] == 0).all())
    wq, before = mods["layers.0.attention.wq"].weight, load_hf(tiny_model_dir).layers["0"].attention.wq.weight
    assert torch.equal(wq[:16], before[:16])  # declared dense rows stay the teacher's
    assert set(rep["refit"]) and all(v["loss_ratio"] <= 1.0 for v in rep["refit"].values())
    assert "refit_s" in rep["timings_s"]
    err = {k: v["rel_recon_error"] for k, v in rep["per_module"].items()}
    if method == "sparsegpt":  # Wanda's plain run has no Hessian, hence no error to compare with
        base = {k: v["rel_recon_error"] for k, v in rep_p["per_module"].items()}
        assert all(err[k] <= base[k] * (1 + 1e-4) for k in err if k.startswith("layers.0.")), (err, base)
        assert sum(err.values()) < sum(base.values())
    else:
        assert all(0 < e < 1 for e in err.values())
    if method == "sparsegpt":  # teacher targets: block 0's are its own output (C = H), later blocks' are not
        teach = load_hf(tiny_model_dir)
        masks_t, rep_t = prune_model(teach, windows, method, pattern=NMPattern(2, 4), cfg=cfg, progress=False,
                                     refit="teacher", dense_rows={"layers.0.attention.wq": torch.arange(64) < 16})
        mods_t = dict(teach.named_modules())
        for name in masks_t:
            assert bool((mods_t[name].weight[~masks_t[name]] == 0).all())
            if name.startswith("layers.0."):
                torch.testing.assert_close(mods_t[name].weight, mods[name].weight, rtol=1e-3, atol=1e-4)
        assert all(v["objective_drop"] >= 0 and "loss_ratio" not in v for v in rep_t["refit"].values())
        assert not torch.allclose(mods_t["layers.1.feed_forward.w2"].weight, mods["layers.1.feed_forward.w2"].weight)
    with pytest.raises(SmeltError, match="refit needs a method"):
        prune_model(load_hf(tiny_model_dir), windows, "obs", 0.5, cfg=cfg, progress=False, refit="layer")


def test_protected_rows_stay_dense_and_the_other_rows_are_pruned_as_without_protection(tiny_model_dir, calib):
    cfg, windows = calib
    protected = [("0", 1)]  # head 1 of layer 0: q rows 16..32; GQA 4/2 -> KV group 0: k/v rows 0..16
    c = tiny_config(max_seq_len=512)
    dense = dense_rows(protected, c.n_heads, c.n_kv_heads, c.head_dim)
    plain, prot = load_hf(tiny_model_dir), load_hf(tiny_model_dir)
    before = prot.layers["0"].attention.wq.weight.clone()
    masks_p, _ = prune_model(plain, windows, "sparsegpt", pattern=NMPattern(2, 4), cfg=cfg, progress=False)
    masks, report = prune_model(prot, windows, "sparsegpt", pattern=NMPattern(2, 4), cfg=cfg, progress=False,
                                dense_rows=dense)
    wq, wq_p = prot.layers["0"].attention.wq.weight, plain.layers["0"].attention.wq.weight
    rows = dense["layers.0.attention.wq"]
    assert rows.nonzero().flatten().tolist() == list(range(16, 32))
    assert torch.equal(wq[rows], before[rows]) and masks["layers.0.attention.wq"][rows].all()
    assert torch.equal(wq[~rows], wq_p[~rows])  # rows are independent: the rest is pruned exactly as before
    name = "layers.0.attention.wk"
    assert not NMPattern(2, 4).holds(masks[name]) and NMPattern(2, 4).holds(masks[name], dense[name])
    assert report["per_module"][name]["dense_rows"] == 16 and "dense_rows" not in report["per_module"][
        "layers.0.attention.wo"]
    with pytest.raises(SmeltError, match="not pruned"):
        prune_model(load_hf(tiny_model_dir), windows, "magnitude", pattern=NMPattern(2, 4), skip=(*DEFAULT_SKIP, "wq"),
                    dense_rows=dense, progress=False)


def test_cli_protect_declares_dense_rows_and_refuses_a_bad_heads_file(tiny_model_dir, tmp_path, capsys):
    heads = tmp_path / "heads.json"
    heads.write_text(json.dumps({"protected": [{"layer": "1", "head": 3, "why": ["sink"]}]}))
    out = tmp_path / "pruned"
    run_cli(lambda: main(["--teacher", str(tiny_model_dir), "--method", "magnitude", "--pattern", "2:4",
                          "--protect", str(heads), "--out", str(out)]))
    dense = load_dense_rows(out)
    assert {k: v.nonzero().flatten().tolist() for k, v in dense.items()} == {
        "layers.1.attention.wq": list(range(48, 64)), "layers.1.attention.wk": list(range(16, 32)),
        "layers.1.attention.wv": list(range(16, 32))}
    assert json.loads((out / "manifest.json").read_text())["settings"]["dense_rows"] == {k: 16 for k in dense}
    heads.write_text(json.dumps({"protected": [{"layer": "1", "head": 4, "why": ["sink"]}]}))
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        run_cli(lambda: main(["--teacher", str(tiny_model_dir), "--method", "magnitude", "--pattern", "2:4",
                              "--protect", str(heads), "--out", str(tmp_path / "bad")]))
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and err.count("\n") == 0 and "--protect" in err and "head 4" in err, err
    assert not (tmp_path / "bad").exists()


def test_cli_protect_with_skipped_modules_declares_rows_only_where_it_prunes(tiny_model_dir, tmp_path):
    """--skip attention.wq,attention.wk with --protect: q/k stay whole (no mask), the protected head's
    KV group keeps its wv rows dense, and the rest of wv is 2:4."""
    heads = tmp_path / "heads.json"
    heads.write_text(json.dumps({"protected": [{"layer": "1", "head": 3, "why": ["sink"]}]}))
    out = tmp_path / "pruned"
    run_cli(lambda: main(["--teacher", str(tiny_model_dir), "--method", "magnitude", "--pattern", "2:4",
                          "--skip", "output,tok_embeddings,attention.wq,attention.wk",
                          "--protect", str(heads), "--out", str(out)]))
    dense = load_dense_rows(out)
    assert {k: v.nonzero().flatten().tolist() for k, v in dense.items()} == {
        "layers.1.attention.wv": list(range(16, 32))}
    masks = load_masks(out)
    assert not any(k.endswith(("attention.wq", "attention.wk")) for k in masks)
    wv = masks["layers.1.attention.wv"]
    assert wv[16:32].all() and not wv[:16].all() and NMPattern(2, 4).holds(wv, dense["layers.1.attention.wv"])


@pytest.mark.parametrize("method", ["magnitude", "wanda", "obs"])
def test_other_methods_and_skip_patterns(tiny_model_dir, calib, method):
    cfg, windows = calib
    model = load_hf(tiny_model_dir)
    wo = model.layers["0"].attention.wo.weight.clone()
    skip = ("output", "tok_embeddings", "attention.wo", "layers.1")
    masks, report = prune_model(model, windows, method, sparsity=0.5, skip=skip, cfg=cfg, progress=False)
    assert sorted(masks) == [f"layers.0.{n}" for n in ("attention.wk", "attention.wq", "attention.wv",
                                                        "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")]
    assert torch.equal(model.layers["0"].attention.wo.weight, wo)
    assert report["sparsity"] == pytest.approx(0.5, abs=0.01)
    calibrated = method != "magnitude"
    assert all(("rel_recon_error" in e) == (method in ("sparsegpt", "obs")) for e in report["per_module"].values())
    assert (report["timings_s"]["forward_s"] > 0) == calibrated  # magnitude runs no forward pass
    assert (report["timings_s"]["hessian_inverse_s"] > 0) == (method == "obs")  # only OBS factors H here


def test_too_few_calibration_tokens_for_the_hessian_warn_with_the_figure(tiny_model_dir, calib, capsys):
    cfg, windows = calib
    model = load_hf(tiny_model_dir)
    prune_model(model, windows[:1, :16], "sparsegpt", 0.5, cfg=CalibConfig(n_windows=1, seq_len=16), progress=False)
    err = capsys.readouterr().err
    assert "warning: 16 calibration tokens are fewer than the 128 inputs of the widest calibrated Linear" in err
    prune_model(load_hf(tiny_model_dir), windows[:1, :16], "wanda", 0.5, cfg=CalibConfig(n_windows=1, seq_len=16),
                progress=False)
    assert "warning" not in capsys.readouterr().err  # Wanda needs no Hessian


def test_prune_model_rejects_bad_settings(tiny_model_dir, calib):
    cfg, windows = calib
    model = load_hf(tiny_model_dir)
    with pytest.raises(SmeltError, match="no calibration data"):
        prune_model(model, None, "wanda", 0.5, progress=False)
    with pytest.raises(SmeltError, match="outside the transformer blocks"):
        prune_targets(model, skip=("tok_embeddings",))
    with pytest.raises(SmeltError, match="matches no module"):
        prune_targets(model, skip=("output", "attention.wz"))
    for hessian in ("float64", "float32"):  # 8 tokens, 64 inputs: rank-deficient in any precision
        with pytest.raises(SmeltError, match=r"layers\.0\.attention\.wq: Hessian is singular"):
            prune_model(model, windows[:1, :8], "sparsegpt", 0.5, percdamp=0.0,
                        cfg=CalibConfig(n_windows=1, seq_len=8, forward="float32", hessian=hessian), progress=False)
    with pytest.raises(SmeltError, match="hessian=bfloat16 needs percdamp > 0"):  # too coarse for the rank test
        prune_model(model, windows[:1, :8], "sparsegpt", 0.5, percdamp=0.0,
                    cfg=CalibConfig(n_windows=1, seq_len=8, hessian="bfloat16"), progress=False)
    with pytest.raises(SmeltError, match="n_windows=0 must be >= 1: no calibration data"):
        CalibConfig(n_windows=0)


def _cli(*args: str) -> list[str]:
    return ["--calib-windows", "4", "--calib-seq-len", "64", "--calib-batch-size", "2", *args]


def test_cli_end_to_end(tiny_model_dir, tmp_path):
    out = tmp_path / "pruned"
    proc = subprocess.run([sys.executable, "-m", "prune.run", "--teacher", str(tiny_model_dir), "--method",
                           "sparsegpt", "--pattern", "2:4", "--out", str(out), "--eval", "--eval-windows",
                           "en=2,zh=1,code=1", "--eval-seq-len", "64", *_cli()],
                          cwd=ROOT, capture_output=True, text=True, env=os.environ, check=False, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "top1_agree" in proc.stderr  # the eval table (the child evaluation prints it)
    assert {"model.safetensors", "masks.safetensors", "manifest.json", "config.json"} <= {p.name for p in out.iterdir()}
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["stage"] == "prune" and manifest["settings"]["pattern"] == "2:4"
    assert manifest["settings"]["calibration"]["corpus_record"]["corpus"] == "wikitext2-valid"
    per_module = manifest["metrics"]["per_module"]
    assert len(per_module) == 14 and all(set(v) == {"sparsity", "rel_recon_error"} for v in per_module.values())
    assert set(manifest["metrics"]["eval"]) == {"en", "zh", "code"}
    model = load_hf(out)
    masks = load_masks(out)
    assert sorted(masks) == sorted(per_module)
    mods = dict(model.named_modules())
    assert all(bool((mods[k].weight[~v] == 0).all()) for k, v in masks.items())
    assert all(NMPattern(2, 4).holds(mods[k].weight) for k in masks)


BAD = [
    (["--method", "sparsegpt", "--sparsity", "1.0"], "sparsity=1.0 must be in [0, 1)"),
    (["--method", "wanda", "--pattern", "2-4"], "--pattern must be N:M"),
    (["--method", "wanda", "--pattern", "3:5"], "needs in_features divisible by M=5"),
    (["--method", "prune-everything", "--sparsity", "0.5"], "unknown method"),
    (["--method", "sparsegpt", "--sparsity", "0.5", "--calib-windows", "0"], "no calibration data"),
    (["--method", "wanda"], "one of the arguments --sparsity --pattern is required"),
    (["--method", "sparsegpt", "--sparsity", "0.5", "--percdamp", "0", "--calib-windows", "1",
      "--calib-seq-len", "8"], "Hessian is singular"),
    (["--method", "wanda", "--sparsity", "0.5", "--calib-corpus", "wikitext2-test"], "never be calibrated on"),
    (["--method", "wanda", "--sparsity", "0.5", "--calib-corpus", "wikitext2-valid+"], "corpus '' is unknown"),
    (["--method", "magnitude", "--pattern", "2:4", "--refit", "layer"], "refit needs a method"),
    (["--method", "sparsegpt", "--pattern", "2:4", "--refit", "teacher", "--no-sequential"],
     "--refit teacher needs sequential calibration"),
    (["--method", "sparsegpt", "--pattern", "2:4", "--refit", "teacher", "--calib-true-sequential"],
     "--refit teacher needs the block-at-a-time order"),
    (["--method", "wanda", "--pattern", "2:4", "--no-sequential", "--calib-true-sequential"],
     "--calib-true-sequential needs sequential calibration"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[m for _, m in BAD])
def test_cli_bad_input_is_one_line_and_writes_nothing(tiny_model_dir, tmp_path, capsys, args, message):
    out = tmp_path / "pruned"
    argv = ["--teacher", str(tiny_model_dir), "--out", str(out), *_cli(), *args]
    with pytest.raises(SystemExit) as exc:
        run_cli(lambda: main(argv))
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    # tqdm's bar and a calibration warning (too few tokens for a Hessian) may precede late errors
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith(("calibrate", "warning:"))]
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["teacher"]  # no output, no temp directory


def test_cli_refuses_existing_out_in_a_real_process(tiny_model_dir, tmp_path):
    out = tmp_path / "pruned"
    out.mkdir()
    proc = subprocess.run([sys.executable, "-m", "prune.run", "--teacher", str(tiny_model_dir), "--method",
                           "magnitude", "--sparsity", "0.5", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, env=os.environ, check=False, timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith("error:") and len(proc.stderr.splitlines()) == 1
    assert "already exists" in proc.stderr and list(out.iterdir()) == []


def test_prune_bench_prints_time_memory_and_split(tiny_model_dir):
    import subprocess
    import sys

    from conftest import ROOT

    proc = subprocess.run([sys.executable, "-m", "prune.bench", "--teacher", str(tiny_model_dir),
                           "--calib-windows", "4", "--calib-seq-len", "32"], cwd=ROOT, capture_output=True,
                          text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "peak RSS" in proc.stdout and "forward_s" in proc.stdout and "hessian_inverse_s" in proc.stdout


def test_nm_sparsegpt_one_sweep_over_shared_inputs_equals_one_sweep_each(tiny_model_dir, calib):
    from prune.algorithms import sparsegpt_prune

    cfg, windows = calib
    model = load_hf(tiny_model_dir)
    names = [f"layers.0.{n}" for n in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1",
                                       "feed_forward.w3")]
    dense = {n: model.get_submodule(n).weight.detach().clone() for n in names}
    got = collect(load_hf(tiny_model_dir), windows, cfg, targets=set(names))["layers.0"]
    masks, _ = prune_model(model, windows, "sparsegpt", pattern=NMPattern(2, 4), cfg=cfg, progress=False)
    for name in names:
        w_ref, keep_ref = sparsegpt_prune(dense[name], got[name][0], pattern=NMPattern(2, 4))
        assert torch.equal(masks[name], keep_ref), name
        assert torch.allclose(model.get_submodule(name).weight, w_ref, atol=1e-6 * float(w_ref.abs().max()))


def test_linear_stats_tiles_give_the_full_symmetric_hessian():
    from core.linear_stats import SYM_TILE, LinearStats

    d = 2 * SYM_TILE + 76  # three tile rows, the last one narrow
    X = torch.randn(2, 300, d, dtype=torch.float64)
    for product in (torch.float64, torch.float32):
        st = LinearStats(d, torch.float64, product_dtype=product)
        for x in X:
            st.add(x)
            st.end_batch()
        ref = (X.reshape(-1, d).T @ X.reshape(-1, d))
        assert st.H.dtype == product and torch.equal(st.H, st.H.T)
        assert torch.allclose(st.H.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
