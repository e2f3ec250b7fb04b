"""Head scores: sink mass on BOS, retrieval (top-1 attention on the copied needle token), activation
importance from the calibration engine, and the protected set."""
from __future__ import annotations

import json
import subprocess
import sys

import torch
from conftest import ROOT, tiny_config

from core.data import calibration_windows, corpus_tokens
from core.needle import NeedleConfig
from models.llama import build_model
from prune.heads import protected_heads, retrieval, sink_and_importance


def test_sink_scores_are_attention_mass_on_bos_and_importance_is_the_activation_norm(byte_tokenizer):
    model = build_model(tiny_config(max_seq_len=256), seed=0).eval()
    windows = calibration_windows(byte_tokenizer, 4, 48)
    s = sink_and_importance(model, windows, batch_size=2)
    assert s["sink"].shape == (2, 4) and bool(((s["sink"] > 0) & (s["sink"] <= 1)).all())
    # The same numbers by hand from one full forward with the attention captured.
    layer = model.layers["1"].attention
    layer.capture_attn, seen = True, {}
    h = layer.register_forward_hook(lambda m, a, o: seen.update(p=m.last_attn))  # returns None
    model(windows)
    h.remove()
    layer.capture_attn = False
    assert torch.allclose(s["sink"][1], seen["p"][:, :, 1:, 0].double().mean((0, 2)).float(), atol=1e-6)
    acts = {}
    h = model.layers["0"].feed_forward.w2.register_forward_pre_hook(lambda m, a: acts.update(x=a[0]))
    model(windows)
    h.remove()
    assert torch.allclose(s["channel_importance"][0], acts["x"].double().square().sum((0, 1)).sqrt().float(),
                          rtol=1e-4)
    assert s["head_importance"].shape == (2, 4) and s["channel_importance"].shape == (2, 128)


def test_retrieval_counts_heads_whose_top_attention_copies_the_needle(byte_tokenizer, monkeypatch):
    model = build_model(tiny_config(max_seq_len=256), seed=0).eval()
    cfg = NeedleConfig(lengths=(200,), depths=(0.5,), samples=2)
    hay = corpus_tokens(byte_tokenizer, "wikitext2-valid")
    # Force head 2 of layer 0 to look at the needle's copy of the token it is producing; others at BOS.
    from models import llama

    real = llama.Attention.forward

    def forward(self, x, cos, sin, cache=None):
        out = real(self, x, cos, sin, cache)
        if self.capture_attn and self is model.layers["0"].attention:
            p = torch.zeros_like(self.last_attn)
            p[..., 0] = 1.0
            ids = forward.ids
            for b in range(ids.shape[0]):
                for q in range(ids.shape[1] - 1):
                    same = (ids[b, :q + 1] == ids[b, q + 1]).nonzero().flatten()
                    inside = same[(same >= forward.spans[b][0]) & (same < forward.spans[b][1])]
                    if len(inside):
                        p[b, 2, q] = 0
                        p[b, 2, q, inside[0]] = 1.0
            self.last_attn = p
        return out

    import core.needle as core_needle
    from prune import heads

    orig = heads.make_prompts

    def prompts(*a):
        ps = orig(*a)
        forward.spans = [p["needle_span"] for p in ps]
        return ps

    def walk(model_, windows, reduce, batch_size, targets=()):
        forward.ids = windows
        return heads_walk(model_, windows, reduce, batch_size, targets)

    heads_walk = heads._walk
    monkeypatch.setattr(heads, "make_prompts", prompts)
    monkeypatch.setattr(heads, "_walk", walk)
    monkeypatch.setattr(llama.Attention, "forward", forward)
    r = retrieval(model, byte_tokenizer, hay, cfg, batch_size=2)
    assert r.shape == (2, 4) and r[0, 2] == 1.0 and r[0, [0, 1, 3]].sum() == 0
    assert core_needle.make_prompts is orig


def test_protected_set_takes_the_top_heads_of_each_score():
    scores = {"sink": torch.tensor([[0.9, 0.1], [0.2, 0.3]]), "retrieval": torch.tensor([[0.0, 0.5], [0.9, 0.0]])}
    got = protected_heads(scores, ["0", "1"], top_k=1)
    assert got == [{"layer": "0", "head": 0, "why": ["sink"]}, {"layer": "1", "head": 0, "why": ["retrieval"]}]
    got = protected_heads(scores, ["0", "1"], top_k=2)
    assert {(p["layer"], p["head"]) for p in got} == {("0", 0), ("1", 1), ("1", 0), ("0", 1)}


def test_cli_scores_a_tiny_model_and_refuses_bad_settings(tmp_path, tiny_model_dir):
    out = tmp_path / "heads.json"
    cmd = [sys.executable, "-m", "prune.heads", "--teacher", str(tiny_model_dir), "--calib-windows", "2",
           "--calib-seq-len", "64", "--needle-lengths", "200", "--needle-samples", "1", "--top-k", "2",
           "--out", str(out), "--png", str(tmp_path / "heads.png")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(out.read_text())
    assert len(r["sink"]) == 2 and len(r["retrieval"][0]) == 4 and 2 <= len(r["protected"]) <= 4
    assert (tmp_path / "heads.png").stat().st_size > 1000
    bad = subprocess.run(cmd[:-4] + ["--needle-lengths", "9000", "--out", str(tmp_path / "x.json")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, check=False)
    assert bad.returncode == 2 and "--needle-lengths 9000 exceeds the model's context" in bad.stderr
    assert not (tmp_path / "x.json").exists()
