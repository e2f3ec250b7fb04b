"""kernels.bench's parts that do not need a GPU: every path it times computes y = x @ W.T for the same W (the
kernels in the interpreter, tinygemm's CPU twin for the W4 anchor's scale convention), the model estimates it
sets beside the measurements, and its one-line refusals."""
from __future__ import annotations

import json

import pytest
import torch

from core.errors import SmeltError
from kernels import bench


def test_every_timed_path_computes_the_same_product():
    gen = torch.Generator().manual_seed(0)
    w = bench.random_weight(64, 128, gen, "cpu")
    assert w["scale"].shape == (64, 128 // bench.GROUP)  # the release's group 64
    x = torch.randn(3, 128, generator=gen).to(torch.bfloat16)
    paths = bench._paths(x, w)
    assert set(paths) == set(bench.PATHS)
    ran = []
    for name, run in paths.items():
        if isinstance(run, str):  # cuSPARSELt has no CPU path: recorded as the row's error
            assert name == "torch 2:4" and "CUDA" in run
            continue
        call, ref_w = run
        ref = x.float() @ ref_w.T
        err = ((call().float() - ref).abs().max() / ref.abs().max()).item()
        assert err < 1.6e-2, (name, err)
        ran.append(name)
    assert {"bf16", "w4", "24", "24w4", "tinygemm w4"} <= set(ran)
    # the 2:4 paths multiply the pruned weight (two of every four inputs), the W4 paths the whole one
    assert (w["w24"].reshape(64, -1, 4) != 0).sum(-1).max().item() <= 2


def test_model_estimates_are_read_for_smelts_kernels_only(tmp_path):
    rows = [{"model": "llama-3.1-8b", "layer": "q", "M": 1, "format": "w4", "speedup_vs_bf16": 3.0},
            {"model": "llama-3.1-8b", "layer": "q", "M": 1, "format": "bf16", "speedup_vs_bf16": 1.0},
            {"model": "llama-3.1-8b", "layer": "k", "M": 1, "format": "24", "error": "no variant fits"}]
    (tmp_path / "i.json").write_text(json.dumps({"model": {"rows": rows}}))
    assert bench.model_estimates(tmp_path / "i.json") == {("llama-3.1-8b", "q", 1, "w4"): 3.0}
    assert bench.model_estimates(tmp_path / "missing.json") == {}


@pytest.mark.parametrize("args,text", [(["--models", "gpt2"], "--models"), (["--m", "1,x"], "--m"),
                                       (["--m", "0"], "--m"), (["--decode-tokens", "-1"], "--decode-tokens")])
def test_bad_arguments_are_one_line_before_any_gpu_work(args, text):
    with pytest.raises(SmeltError, match=text):
        bench.main(args)
