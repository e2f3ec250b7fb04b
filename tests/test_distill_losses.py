"""Distillation losses against brute-force references (values and gradients), chunking invariance."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from core.errors import SmeltError
from distill.losses import KINDS, DistillLoss, DistillLossConfig


def brute_force(kind, s, t, T, alpha):
    p, q = F.softmax(t.double() / T, -1), F.softmax(s.double() / T, -1)
    kl = lambda a, b: (a * (a.log() - b.log())).sum(-1)
    if kind == "forward_kl":
        d = kl(p, q)
    elif kind == "reverse_kl":
        d = kl(q, p)
    elif kind == "skew_kl":
        d = kl(p, alpha * p + (1 - alpha) * q)
    else:
        m = (p + q) / 2
        d = (kl(p, m) + kl(q, m)) / 2
    return d * T * T


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("T", [1.0, 2.5])
def test_loss_and_gradient_match_brute_force(kind, T):
    g = torch.Generator().manual_seed(1)
    s = (torch.randn(3, 7, 40, generator=g) * 2).requires_grad_()
    t = torch.randn(3, 7, 40, generator=g) * 2
    labels = torch.randint(0, 40, (3, 7), generator=g)
    labels[0, :2] = -100
    loss_fn = DistillLoss(DistillLossConfig(kind=kind, temperature=T, skew_alpha=0.2, ce_weight=0.3,
                                            chunk_tokens=5))
    loss, parts = loss_fn(s, t, labels)
    loss.backward()
    s_ref = s.detach().double().requires_grad_()
    valid = (labels != -100).reshape(-1)
    d = brute_force(kind, s_ref.reshape(-1, 40), t.reshape(-1, 40), T, 0.2)[valid]
    ce = F.cross_entropy(s_ref.reshape(-1, 40)[valid], labels.reshape(-1)[valid], reduction="none")
    ref = (d + 0.3 * ce).mean()
    ref.backward()
    assert abs(loss.item() - ref.item()) < 1e-5
    assert abs(parts["kd"].item() - d.mean().item()) < 1e-5
    assert torch.allclose(s.grad.double(), s_ref.grad, atol=1e-6)
    assert s.grad[0, :2].abs().max() == 0  # ignored tokens get no gradient


def test_chunk_size_does_not_change_the_result():
    s = torch.randn(50, 30, requires_grad=True)
    t = torch.randn(50, 30)
    grads = []
    for chunk in (1, 7, 1000):
        s.grad = None
        loss, _ = DistillLoss(DistillLossConfig(chunk_tokens=chunk))(s, t)
        loss.backward()
        grads.append((loss.item(), s.grad.clone()))
    for lo, gr in grads[1:]:
        assert abs(lo - grads[0][0]) < 1e-5 and torch.allclose(gr, grads[0][1], atol=1e-6)


@pytest.mark.parametrize("chunk", [3, 1000])
def test_tail_weight_counts_the_batch_tail_extra(chunk):
    # The threshold is the quantile over all valid tokens of the batch, not of one chunk.
    g = torch.Generator().manual_seed(2)
    s = (torch.randn(40, 30, generator=g) * 2).requires_grad_()
    t = torch.randn(40, 30, generator=g) * 2
    labels = torch.randint(0, 30, (40,), generator=g)
    labels[:5] = -100
    loss, parts = DistillLoss(DistillLossConfig(tail_weight=3.0, tail_quantile=0.8, chunk_tokens=chunk))(
        s, t, labels)
    loss.backward()
    s_ref = s.detach().double().requires_grad_()
    valid = labels != -100
    d = brute_force("forward_kl", s_ref, t, 1.0, 0.1)[valid]
    tail = d.detach() >= torch.quantile(d.detach(), 0.8)
    assert 0 < tail.sum() < valid.sum()
    ref = (d + 3.0 * d * tail).mean()
    ref.backward()
    assert abs(loss.item() - ref.item()) < 1e-5
    assert abs(parts["kd"].item() - d.mean().item()) < 1e-5  # the logged metric stays the plain mean
    assert torch.allclose(s.grad.double(), s_ref.grad, atol=1e-6)


def test_identical_distributions_give_zero_loss():
    x = torch.randn(10, 20)
    for kind in KINDS:
        loss, _ = DistillLoss(DistillLossConfig(kind=kind))(x.clone().requires_grad_(), x)
        assert abs(loss.item()) < 1e-6


def test_bad_settings_name_the_field():
    with pytest.raises(SmeltError, match="kind='kld'"):
        DistillLossConfig(kind="kld")
    with pytest.raises(SmeltError, match="temperature=0"):
        DistillLossConfig(temperature=0)
    with pytest.raises(SmeltError, match="tail_quantile=1"):
        DistillLossConfig(tail_weight=1.0, tail_quantile=1)
    with pytest.raises(SmeltError, match="tail_weight=-1"):
        DistillLossConfig(tail_weight=-1)
    with pytest.raises(SmeltError, match="student vocab 10 != teacher vocab 12"):
        DistillLoss()(torch.randn(2, 10), torch.randn(2, 12))
