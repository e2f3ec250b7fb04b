"""Sharded loading (each rank reads its own slices) and fp32 fake-quant units under bf16 FSDP2, on 2 gloo ranks."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from conftest import ROOT, tiny_config

from models.hf_io import save_hf
from models.llama import build_model


def test_ranks_load_only_their_shards_and_qat_quantizes_fp32_weights(tmp_path):
    save_hf(build_model(tiny_config(), seed=3), tmp_path)
    out = tmp_path / "result.json"
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{ROOT / 'tests'}", OMP_NUM_THREADS="1", OUT=str(out))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(ROOT / "tests" / "fsdp_worker.py"), str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["shards_equal"] and r["same_logits"]
    assert r["local_numel"] < 0.6 * r["full_numel"]  # rank 0 holds about half the model
    # bf16 compute (the logits), but every fake-quantized linear quantized its fp32 master weight.
    assert r["logits_dtype"] == str(torch.bfloat16)
    assert r["fq_weight_dtypes"] and set(r["fq_weight_dtypes"].values()) == {str(torch.float32)}
    assert r["grad_dtypes"] == [str(torch.float32)]
