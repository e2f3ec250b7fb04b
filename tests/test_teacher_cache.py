"""The teacher's top-k cache: the top-k KL's maths, the build command's refusals, and the trainer reading
windows and teacher from a cache (same run as the teacher's own at k = vocab, resumable, checked against
the run's settings)."""
from __future__ import annotations

import functools
import json
import re
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, launch_log, make_distill_dirs
from safetensors.torch import load_file
from test_trainer import _env, kill_after_checkpoint, torchrun

from core.errors import SmeltError
from core.teacher_topk import TeacherTopK, TopKCache, topk_from_logits
from distill.losses import DistillLoss, DistillLossConfig, divergence, topk_forward_kl

VOCAB = 260  # the tests' byte tokenizer


def test_topk_kl_is_a_proper_divergence_below_the_full_kl():
    g = torch.Generator().manual_seed(0)
    t = 3 * torch.randn(64, 500, generator=g)
    s = t + 0.7 * torch.randn(64, 500, generator=g)
    full = divergence("forward_kl", s, t)
    last = torch.zeros(64)
    for k in (1, 4, 32, 200, 500):
        d = topk_forward_kl(s, topk_from_logits(t, k))
        # the coarsened KL never exceeds the full one (data processing) and grows towards it with k
        assert (d >= -1e-6).all() and (d <= full + 2e-3).all() and (d >= last - 2e-3).all()
        last = d
    assert torch.allclose(last, full, atol=2e-3)  # k = vocab: the full KL, up to the fp16 log-probs
    assert topk_forward_kl(t, topk_from_logits(t, 8)).abs().max() < 1e-3  # zero at the teacher
    x = s.clone().requires_grad_()
    topk_forward_kl(x, topk_from_logits(t, 500)).sum().backward()  # empty tail on both sides: no NaN
    assert torch.isfinite(x.grad).all()
    tk = topk_from_logits(t, 16)
    assert torch.allclose(tk.coarse_logprobs().exp().sum(-1), torch.ones(64))
    with pytest.raises(SmeltError, match=r"top_k=501 must be in \[1, vocab size 500\]"):
        topk_from_logits(t, 501)


def test_distill_loss_takes_a_cached_teacher_only_for_forward_kl_at_t1():
    t = torch.randn(2, 8, 50, generator=torch.Generator().manual_seed(1))
    cached = topk_from_logits(t, 50)
    s = torch.randn(2, 8, 50, requires_grad=True)
    a, _ = DistillLoss()(s, t)
    b, _ = DistillLoss()(s, cached)
    assert torch.allclose(a, b, atol=1e-3)
    with pytest.raises(SmeltError, match="cached teacher .* needs loss.kind=forward_kl"):
        DistillLoss(DistillLossConfig(kind="reverse_kl"))(s, cached)
    with pytest.raises(SmeltError, match="cached teacher has 4 positions, the student.s batch 16"):
        DistillLoss()(s, TeacherTopK(cached.ids[:1, :4], cached.logprobs[:1, :4], cached.rest[:1, :4]))


def _build(dirs, out, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "distill.teacher_cache", "--teacher", str(dirs / "teacher"), "--seq-len", "32",
           "--windows", "24", "--ranks", "2", "--local-batch", "2", "--out", str(out), *extra]
    return subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    d = make_distill_dirs(tmp_path_factory.mktemp("teacher-cache"))
    for k in (VOCAB, 8):
        proc = _build(d, d / f"cache-{k}", "--top-k", str(k))
        assert proc.returncode == 0, proc.stderr[-2000:]
    return d


def test_the_build_refuses_a_top_k_larger_than_the_vocabulary(dirs):
    for k, msg in ((VOCAB + 1, f"--top-k={VOCAB + 1} must be in \\[1, {VOCAB}\\]"), (0, "--top-k=0 must be")):
        proc = _build(dirs, dirs / "bad", "--top-k", str(k))
        assert proc.returncode != 0 and not (dirs / "bad").exists()
        assert len(proc.stderr.strip().splitlines()) == 1 and re.search(msg, proc.stderr)
    proc = _build(dirs, dirs / f"cache-{VOCAB}", "--top-k", "4")  # never overwrites a cache
    assert proc.returncode != 0 and "already exists" in proc.stderr
    cache = TopKCache(dirs / "cache-8")
    assert (cache.n_windows, cache.seq_len, cache.top_k) == (24, 32, 8)
    m = json.loads((dirs / "cache-8" / "manifest.json").read_text())
    assert 0 < m["metrics"]["kept_mass_p01"] <= m["metrics"]["kept_mass_mean"] <= 1


def test_a_full_vocabulary_cache_trains_like_the_teacher_itself(dirs):
    """k = vocab: the same windows (the cache's rank layout) and the same KL up to fp16 log-probs, so the
    cached run's losses match the teacher-run's; a top-8 cache trains too and says so in the manifest."""
    runs = {}
    for name, extra in (("teacher", ()), ("full", ("--dataloader.teacher_cache", str(dirs / f"cache-{VOCAB}"))),
                        ("top8", ("--dataloader.teacher_cache", str(dirs / "cache-8")))):
        proc = torchrun(dirs, name, *extra)
        assert proc.returncode == 0, launch_log(proc)
        runs[name] = [float(x) for x in re.findall(r"step:\s+\d+\s+loss:\s+([0-9.]+)",
                                                                 proc.stdout + proc.stderr)]
    assert len(runs["teacher"]) == 6 and runs["full"] == pytest.approx(runs["teacher"], rel=1e-3)
    assert runs["top8"] != runs["full"] and runs["top8"][-1] < runs["top8"][0]
    settings = json.loads((dirs / "top8-out" / "manifest.json").read_text())["settings"]
    assert settings["data"]["teacher_cache"] == str(dirs / "cache-8")
    # killed after a checkpoint, the cached run resumes at the same window and ends bit-identical
    kill_after_checkpoint(dirs, "top8-killed", "--dataloader.teacher_cache", str(dirs / "cache-8"))
    resumed = torchrun(dirs, "top8-killed", "--dataloader.teacher_cache", str(dirs / "cache-8"))
    assert resumed.returncode == 0, launch_log(resumed)
    a, b = load_file(str(dirs / "top8-out" / "model.safetensors")), load_file(str(dirs / "top8-killed-out" /
                                                                                    "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_trainer_holds_the_cache_to_the_run(dirs, tmp_path):
    from train import cpu_shims

    cpu_shims.apply()
    from train.config_registry import debug_distill
    from train.trainer import check_config

    def cfg(**over):
        c = debug_distill()
        c.student, c.teacher, c.dataloader.teacher_cache = str(dirs / "student"), str(dirs / "teacher"), \
            str(dirs / "cache-8")
        for k, v in over.items():
            obj, _, attr = k.rpartition(".")
            setattr(functools.reduce(getattr, obj.split("."), c) if obj else c, attr, v)
        return c

    check_config(cfg())
    for over, msg in (({"training.seq_len": 64}, "holds 32-token windows; --training.seq_len is 64"),
                      ({"dataloader.seed": 3}, "holds --dataloader.source wikitext2-valid seed 0"),
                      ({"dataloader.shuffle_buffer": 0}, "built with --dataloader.shuffle_buffer 64"),
                      ({"loss.kind": "reverse_kl"}, "--loss.kind must be forward_kl"),
                      ({"dataloader.teacher_cache": str(tmp_path)}, "no teacher_topk.safetensors"),
                      ({"teacher": str(dirs / "student")}, "was built from another teacher")):
        with pytest.raises(SmeltError, match=msg):
            check_config(cfg(**over))
    proc = torchrun(dirs, "mismatch", "--dataloader.teacher_cache", str(dirs / "cache-8"), "--training.seq_len", "16")
    assert proc.returncode != 0 and "holds 32-token windows" in proc.stderr
    assert not (dirs / "mismatch-out").exists()
