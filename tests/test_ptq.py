"""PTQ baselines: RTN and GPTQ through the calibration engine, into a releasable quantized artifact."""
from __future__ import annotations

import subprocess
import sys

import torch
from conftest import ROOT, tiny_config

from core.calibrate import CalibConfig
from core.patterns import NMPattern
from models.hf_io import load_hf, save_hf
from models.llama import build_model
from qat.ptq import quantize_model
from qat.qparams import read_qparams
from qat.quantizers import QuantSpec


def _on_grid(w, scale, group):
    q = w / scale.repeat_interleave(group, dim=1)
    return (q - q.round()).abs().max().item() < 1e-4 and q.round().abs().max().item() <= 8


def test_gptq_beats_rtn_on_the_model_output_and_keeps_masks(tiny_model_dir, byte_tokenizer):
    spec = QuantSpec(bits=4, group_size=32)
    calib = CalibConfig(n_windows=8, seq_len=64, batch_size=4)
    windows = calib.windows(byte_tokenizer)
    ref = load_hf(tiny_model_dir)
    masks = {n: NMPattern(2, 4).keep_top(m.weight.abs()) for n, m in ref.named_modules()
             if isinstance(m, torch.nn.Linear) and n != "output"}
    with torch.no_grad():
        for n, m in ref.named_modules():
            if n in masks:
                m.weight.mul_(masks[n])
    outs = {}
    for method in ("rtn", "gptq"):
        model = load_hf(tiny_model_dir)
        model.load_state_dict(ref.state_dict())
        qparams, report = quantize_model(model, method, spec, masks, windows, calib, progress=False)
        assert report["modules"] == len(masks) == len(qparams)
        for n, m in model.named_modules():
            if n in masks:
                assert NMPattern(2, 4).holds(m.weight != 0) and (m.weight[~masks[n]] == 0).all()
                assert _on_grid(m.weight.detach(), qparams[n][0], 32)
        with torch.no_grad():
            outs[method] = (model(windows[:4]) - ref(windows[:4])).pow(2).mean().item()
    assert outs["gptq"] < outs["rtn"]


def test_ptq_cli_writes_a_quantized_artifact(tiny_model_dir, tmp_path, byte_tokenizer):
    out = tmp_path / "rtn"
    proc = subprocess.run([sys.executable, "-m", "qat.ptq", "--teacher", str(tiny_model_dir), "--method", "rtn",
                           "--group-size", "32", "--out", str(out)], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    bad_corpus = subprocess.run([sys.executable, "-m", "qat.ptq", "--teacher", str(tmp_path / "nowhere"),
                                 "--method", "gptq", "--calib-corpus", "zh", "--out", str(tmp_path / "g")],
                                cwd=ROOT, capture_output=True, text=True)
    assert bad_corpus.returncode == 2 and "corpus 'zh' is not allowed" in bad_corpus.stderr  # before loading
    assert not (tmp_path / "g").exists()
    undamped = subprocess.run([sys.executable, "-m", "qat.ptq", "--teacher", str(tmp_path / "nowhere"),
                               "--method", "gptq", "--calib-hessian", "bfloat16", "--percdamp", "0",
                               "--out", str(tmp_path / "g")], cwd=ROOT, capture_output=True, text=True,
                              check=False)
    assert undamped.returncode == 2 and undamped.stderr.strip().splitlines()[-1] == (  # before loading
        "error: calibration hessian=bfloat16 needs percdamp > 0: its bf16 products' rounding would hide a "
        "singular Hessian from the rank test")
    assert not (tmp_path / "g").exists()
    qparams, spec = read_qparams(out)
    assert spec.group_size == 32 and len(qparams) == 7 * 2
    bad = subprocess.run([sys.executable, "-m", "qat.ptq", "--teacher", str(tiny_model_dir), "--method", "rtn",
                          "--group-size", "48", "--out", str(tmp_path / "bad")], cwd=ROOT, capture_output=True,
                         text=True)
    assert bad.returncode == 2 and "group_size=48 does not divide" in bad.stderr
    assert not (tmp_path / "bad").exists()
    skip = subprocess.run([sys.executable, "-m", "qat.ptq", "--teacher", str(tiny_model_dir), "--method", "gptq",
                           "--skip", "output,attention.wz", "--out", str(tmp_path / "skip")], cwd=ROOT,
                          capture_output=True, text=True)
    assert skip.returncode == 2 and skip.stderr.strip().splitlines()[-1] == (
        "error: --skip: 'attention.wz' matches no module of the model "
        "(names look like 'output', 'layers.0', 'attention.wq')")
    assert not (tmp_path / "skip").exists()
    kept = tmp_path / "kept"
    proc = subprocess.run([sys.executable, "-m", "qat.ptq", "--teacher", str(tiny_model_dir), "--method", "rtn",
                           "--group-size", "32", "--skip", "output,layers.1", "--out", str(kept)], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(read_qparams(kept)[0]) == sorted(n for n in qparams if n.startswith("layers.0."))
    # an untied head, outside the blocks: RTN quantizes it (its qparams written after the blocks'), GPTQ,
    # which calibrates block by block, refuses it rather than leave it unquantized
    untied = tmp_path / "untied"
    untied.mkdir()
    model = build_model(tiny_config("debug-untied", max_seq_len=512), seed=1)
    save_hf(model, untied, tokenizer=byte_tokenizer)
    head = subprocess.run([sys.executable, "-m", "qat.ptq", "--teacher", str(untied), "--method", "rtn",
                           "--group-size", "32", "--skip", "tok_embeddings", "--out", str(tmp_path / "head")],
                          cwd=ROOT, capture_output=True, text=True, check=False)
    assert head.returncode == 0, head.stderr[-2000:]
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert linears[-1] == "output" and sorted(read_qparams(tmp_path / "head")[0]) == sorted(linears)
    gptq_head = subprocess.run([sys.executable, "-m", "qat.ptq", "--teacher", str(untied), "--method",
                                "gptq", "--group-size", "32", "--skip", "tok_embeddings", "--out",
                                str(tmp_path / "gh")], cwd=ROOT, capture_output=True, text=True, check=False)
    assert gptq_head.returncode == 2 and gptq_head.stderr.strip().splitlines()[-1] == (
        "error: --skip: gptq calibrates the transformer blocks only; output is outside them (add it to --skip, "
        "or quantize it with rtn)")
    assert not (tmp_path / "gh").exists()


def test_one_gptq_sweep_over_linears_sharing_an_input_equals_one_sweep_each(tiny_model_dir, byte_tokenizer):
    from core.calibrate import run_blocks
    from qat.gptq import gptq_quantize

    spec = QuantSpec(bits=4, group_size=32)
    calib = CalibConfig(n_windows=4, seq_len=64, batch_size=2)
    windows = calib.windows(byte_tokenizer)
    model = load_hf(tiny_model_dir)
    dense = {n: m.weight.detach().clone() for n, m in model.named_modules() if n.startswith("layers.0.")
             and isinstance(m, torch.nn.Linear)}
    H = {}
    run_blocks(load_hf(tiny_model_dir), windows, lambda b, blk, st: H.update({n: s.H.clone() for n, s in st.items()}),
               calib, targets=set(dense), progress=False)
    qparams, _ = quantize_model(model, "gptq", spec, {}, windows, calib, act_order=True, progress=False)
    mods = dict(model.named_modules())
    for name in ("layers.0.attention.wk", "layers.0.feed_forward.w3"):  # second members of qkv and w1/w3
        w_ref, s_ref, _ = gptq_quantize(dense[name], H[name], spec, act_order=True, name=name)
        assert torch.allclose(mods[name].weight, w_ref, atol=1e-6 * float(w_ref.abs().max()))
        assert torch.allclose(qparams[name][0], s_ref)
