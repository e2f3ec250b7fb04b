"""Evaluation core: KL/PPL maths against brute force, caching, and the per-bucket report."""
from __future__ import annotations

import math

import torch

from core.data import EvalConfig
from eval.evaluate import evaluate, format_table
from eval.metrics import per_token_stats, summarize
from models.hf_io import load_hf


def test_per_token_stats_match_brute_force():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(37, 50, generator=g) * 3
    t_logits = logits + torch.randn(37, 50, generator=g)
    targets = torch.randint(0, 50, (37,), generator=g)
    tlp = torch.log_softmax(t_logits, -1)
    s = per_token_stats(logits, tlp, targets, chunk=8)  # chunking must not change the result
    p, q = tlp.exp(), torch.softmax(logits, -1)
    kl_ref = (p * (p.log() - q.log())).sum(-1)
    assert torch.allclose(s["kl"], kl_ref, atol=1e-5)
    assert torch.allclose(s["nll"], -torch.log_softmax(logits, -1)[torch.arange(37), targets], atol=1e-5)
    assert torch.equal(s["top1_agree"], logits.argmax(-1) == t_logits.argmax(-1))
    m = summarize(s)
    assert abs(m["ppl"] - math.exp(s["nll"].mean().item())) < 1e-3
    assert m["kl_p50"] <= m["kl_p90"] <= m["kl_p99"] <= m["kl_max"]
    self_kl = per_token_stats(t_logits, tlp.half(), targets)["kl"]
    assert self_kl.max().item() < 1e-3


def test_evaluate_teacher_against_itself_and_a_damaged_copy(tiny_model_dir, byte_tokenizer):
    cfg = EvalConfig(seq_len=64, windows={"en": 3, "zh": 2, "code": 2}, batch_size=2)
    teacher = load_hf(tiny_model_dir)
    same = evaluate(teacher, tiny_model_dir, cfg, tokenizer=byte_tokenizer, progress=False)
    for b in ("en", "zh", "code"):
        m = same["buckets"][b]
        assert m["kl_mean"] < 1e-4 and abs(m["ppl"] - m["teacher_ppl"]) / m["ppl"] < 1e-3
        assert m["tokens"] == cfg.windows[b] * (cfg.seq_len - 1)
    damaged = load_hf(tiny_model_dir)
    with torch.no_grad():
        damaged.norm.weight.copy_(torch.randn(damaged.norm.weight.shape) * 5)
    worse = evaluate(damaged, tiny_model_dir, cfg, tokenizer=byte_tokenizer, progress=False)
    assert worse["buckets"]["en"]["kl_mean"] > 1e-3
    assert worse["buckets"]["en"]["top1_agree"] < 1.0
    assert "kl_p99" in format_table(worse)


def test_teacher_logprobs_are_cached(tiny_model_dir, byte_tokenizer, monkeypatch):
    import eval.evaluate as ev

    cfg = EvalConfig(seq_len=32, windows={"en": 2}, batch_size=2)
    model = load_hf(tiny_model_dir)
    evaluate(model, tiny_model_dir, cfg, tokenizer=byte_tokenizer, progress=False)
    monkeypatch.setattr(ev, "load_hf", lambda *a, **k: (_ for _ in ()).throw(AssertionError("recomputed")))
    again = evaluate(model, tiny_model_dir, cfg, tokenizer=byte_tokenizer, progress=False)
    assert again["buckets"]["en"]["kl_mean"] < 1e-4


def test_teacher_against_itself_runs_one_forward(tiny_model_dir, byte_tokenizer, tmp_path, monkeypatch):
    """Building the cache and scoring the teacher share one forward; the report equals the two-pass one."""
    monkeypatch.setenv("SMELT_CACHE", str(tmp_path / "cache"))
    cfg = EvalConfig(seq_len=32, windows={"en": 3, "code": 2}, batch_size=2)
    teacher = load_hf(tiny_model_dir)
    calls = []
    teacher.register_forward_hook(lambda mod, args, out: calls.append(args[0].shape[0]))
    first = evaluate(teacher, tiny_model_dir, cfg, tokenizer=byte_tokenizer, teacher=teacher, progress=False)
    assert sum(calls) == 5  # every window once: the cache's forward gave the statistics too
    assert len(list((tmp_path / "cache" / "teacher_logprobs").glob("*.safetensors"))) == 2  # built here
    calls.clear()
    second = evaluate(teacher, tiny_model_dir, cfg, tokenizer=byte_tokenizer, teacher=teacher, progress=False)
    assert sum(calls) == 5  # cache present: one scoring forward
    assert first["buckets"] == second["buckets"]
