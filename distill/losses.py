"""Distillation losses: forward KL, reverse KL, skew KL, Jensen-Shannon; temperature; optional CE mix.

With p the teacher's and q the student's distribution at temperature T:
  forward_kl  KL(p || q)                  mode-covering; the default (what "match the teacher" means)
  reverse_kl  KL(q || p)                  mode-seeking
  skew_kl     KL(p || a*p + (1-a)*q)      DistiLLM's skewed KL: bounded, stabler early in training
  js          (KL(p||m) + KL(q||m)) / 2,  m = (p + q) / 2
The divergence is multiplied by T^2 so gradient magnitudes do not shrink as T grows (Hinton et al.).

Tail weighting (tail_weight > 0): tokens whose divergence is at or above the batch's tail_quantile
count (1 + tail_weight) times. Compression damage concentrates in few tokens (the P99 the report
tracks), and a plain mean spends most of its gradient on tokens that are already close. The
threshold comes from a no-grad pass over the rank's own tokens, and the weights are constants.

Layer-wise targets (hidden_weight > 0): the outputs of the listed blocks are matched to the teacher's
blocks of the same index, per token, by normalised MSE ||h_s - h_t||^2 / ||h_t||^2 or by 1 - cos,
averaged over the listed blocks and added with weight hidden_weight (intermediate targets, as in
Sparse-Llama's and Minitron's distillation). `hidden_divergence` is the maths; the trainer collects
the block outputs.

Cached teacher (a core.teacher_topk.TeacherTopK instead of teacher logits): the teacher's top-k
log-probs and the log of the mass left over; the divergence is forward KL between the two distributions
coarsened to {top-k tokens, the rest} (topk_forward_kl), at temperature 1 (what the cache holds).

Memory: the fp32 [tokens x vocab] probabilities (vocab 49k-128k) are never all alive at once. The loss
runs token chunk by token chunk; each chunk's gradient w.r.t. the student logits is computed right
away (autograd on the chunk) and kept in the logits' own dtype, and backward only scales it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from core.errors import SmeltError
from core.kl import chunk_tokens, kl_rows
from core.teacher_topk import TeacherTopK

KINDS = ("forward_kl", "reverse_kl", "skew_kl", "js")
HIDDEN_KINDS = ("nmse", "cosine")


def divergence(kind: str, s_logits: torch.Tensor, t_logits: torch.Tensor, temperature: float = 1.0,
               skew_alpha: float = 0.1) -> torch.Tensor:
    """Per-token divergence [N] (already scaled by T^2) between teacher and student logits [N, V]."""
    logq = F.log_softmax(s_logits.float() / temperature, dim=-1)
    logp = F.log_softmax(t_logits.float() / temperature, dim=-1)
    if kind == "forward_kl":
        d = kl_rows(logp, logq)
    elif kind == "reverse_kl":
        d = kl_rows(logq, logp)
    elif kind == "skew_kl":
        logm = torch.logaddexp(logp + torch.log(torch.tensor(skew_alpha)),
                               logq + torch.log1p(torch.tensor(-skew_alpha)))
        d = kl_rows(logp, logm)
    elif kind == "js":
        logm = torch.logaddexp(logp, logq) - torch.log(torch.tensor(2.0))
        d = 0.5 * (kl_rows(logp, logm) + kl_rows(logq, logm))
    else:
        raise SmeltError(f"loss.kind={kind!r} is not one of {', '.join(KINDS)}")
    return d * temperature ** 2


def topk_forward_kl(s_logits: torch.Tensor, teacher: TeacherTopK) -> torch.Tensor:
    """Per-token KL [N] from the teacher's top-k (ids/logprobs [N, k], tail [N]) to the student's logits [N, V],
    both coarsened to (the teacher's top-k tokens, everything else): a proper divergence, zero exactly when
    the student gives each top-k token and the rest the teacher's mass."""
    logq = F.log_softmax(s_logits.float(), dim=-1)
    ids = teacher.ids.long()
    q_rest = logq.scatter(-1, ids, float("-inf")).logsumexp(-1, keepdim=True)  # exact even as it nears 0
    logp, logq = teacher.coarse_logprobs(), torch.cat([logq.gather(-1, ids), q_rest], dim=-1)
    # k = V leaves an empty rest on both sides (-inf - -inf): its term is 0, as p = 0 there.
    return torch.where(logp > float("-inf"), logp.exp() * (logp - logq), 0.0).sum(-1)


def _divergence(kind, s_logits, teacher, temperature, skew_alpha):
    """divergence() for teacher logits, topk_forward_kl for a cached teacher (forward KL at T = 1 only)."""
    if not isinstance(teacher, TeacherTopK):
        return divergence(kind, s_logits, teacher, temperature, skew_alpha)
    if kind != "forward_kl" or temperature != 1.0:
        raise SmeltError(f"a cached teacher (top-k) needs loss.kind=forward_kl and loss.temperature=1 "
                         f"(got {kind}, {temperature}): the cache holds temperature-1 log-probs of k tokens")
    return topk_forward_kl(s_logits, teacher)


def hidden_divergence(kind: str, h_student: torch.Tensor, h_teacher: torch.Tensor) -> torch.Tensor:
    """Per-token distance [...] between student and teacher hidden states [..., d], in fp32: normalised
    MSE (scale-free, so every block weighs alike whatever its activation norm) or 1 - cosine."""
    s, t = h_student.float(), h_teacher.detach().float()
    if kind == "nmse":
        return (s - t).pow(2).sum(-1) / t.pow(2).sum(-1).clamp_min(1e-12)
    if kind == "cosine":
        return 1 - F.cosine_similarity(s, t, dim=-1, eps=1e-8)
    raise SmeltError(f"loss.hidden_kind={kind!r} is not one of {', '.join(HIDDEN_KINDS)}")


def parse_layers(spec: str) -> tuple[str, ...]:
    """ "3,7,11" -> ("3", "7", "11"): block keys of the teacher's numbering (depth-pruned students keep
    it); "" -> (). Checked against the models where both are known (the trainer)."""
    keys = tuple(k.strip() for k in spec.split(",") if k.strip())
    if any(not k.isdigit() for k in keys) or len(set(keys)) != len(keys):
        raise SmeltError(f"loss.hidden_layers={spec!r} must be distinct block indices, e.g. 5,11,17,23,29")
    return keys


class _ChunkedLoss(torch.autograd.Function):
    """sum over tokens of w_kd * D(teacher, student) + w_ce * CE, gradient precomputed per chunk."""

    @staticmethod
    def forward(ctx, s_logits, t_logits, labels, kind, temperature, skew_alpha, ce_weight, chunk,
                tail_quantile, tail_weight, kd_weight=1.0):
        n = s_logits.shape[0]
        threshold = None
        if tail_weight > 0:
            threshold = _tail_threshold(s_logits, t_logits, labels, kind, temperature, skew_alpha, chunk,
                                        tail_quantile)
        grad = torch.empty_like(s_logits) if s_logits.requires_grad else None
        total = s_logits.new_zeros((), dtype=torch.float32)
        kl_sum = s_logits.new_zeros((), dtype=torch.float32)
        ce_sum = s_logits.new_zeros((), dtype=torch.float32)
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            with torch.enable_grad():
                x = s_logits[s:e].detach().requires_grad_(grad is not None)
                d = _divergence(kind, x, t_logits[s:e], temperature, skew_alpha)
                valid = labels[s:e] != -100 if labels is not None else None
                if valid is not None:
                    d = d * valid
                loss = kd_weight * d.sum()
                if threshold is not None:
                    loss = loss + kd_weight * tail_weight * (d * (d.detach() >= threshold)).sum()
                if ce_weight > 0 and labels is not None:
                    ce = F.cross_entropy(x.float(), labels[s:e], ignore_index=-100, reduction="sum")
                    loss = loss + ce_weight * ce
                    ce_sum += ce.detach()
            if grad is not None:
                (g,) = torch.autograd.grad(loss, x)
                grad[s:e] = g.to(grad.dtype)
            total += loss.detach()
            kl_sum += d.detach().sum()
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(kl_sum, ce_sum)
        return total, kl_sum, ce_sum

    @staticmethod
    def backward(ctx, g_total, _g_kl, _g_ce):
        (grad,) = ctx.saved_tensors
        return (grad * g_total.to(grad.dtype) if grad is not None else None,) + (None,) * 10


@torch.no_grad()
def _tail_threshold(s_logits, t_logits, labels, kind, temperature, skew_alpha, chunk, quantile):
    """The `quantile` of the per-token divergence over this batch's valid tokens."""
    parts = []
    for s in range(0, s_logits.shape[0], chunk):
        d = _divergence(kind, s_logits[s:s + chunk], t_logits[s:s + chunk], temperature, skew_alpha)
        parts.append(d[labels[s:s + chunk] != -100] if labels is not None else d)
    d = torch.cat(parts)
    return torch.quantile(d, quantile) if d.numel() else d.new_tensor(float("inf"))


@dataclass(kw_only=True)
class DistillLossConfig:
    """The loss settings; the trainer's `--loss.*` section is this class (train.titan.KDLoss.Config)."""

    kind: str = "forward_kl"
    temperature: float = 1.0
    skew_alpha: float = 0.1    # only for skew_kl
    ce_weight: float = 0.0     # weight of next-token cross-entropy added to the divergence
    kd_weight: float = 1.0     # weight of the divergence (MTP training: CE + kd_weight * KL, ce_weight 1)
    chunk_tokens: int = 0      # tokens per chunk (bounds the fp32 [chunk x vocab] working set); 0: by device
    tail_weight: float = 0.0   # extra weight of tokens at or above the divergence's tail_quantile
    tail_quantile: float = 0.9
    hidden_weight: float = 0.0  # weight of the layer-wise loss (needs a teacher and hidden_layers)
    hidden_layers: str = ""     # block indices whose outputs are matched, e.g. "5,11,17,23,29"
    hidden_kind: str = "nmse"   # nmse or cosine

    @property
    def hidden_keys(self) -> tuple[str, ...]:
        """hidden_layers as block keys (a property: torchtitan may set fields after construction)."""
        return parse_layers(self.hidden_layers)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise SmeltError(f"loss.kind={self.kind!r} is not one of {', '.join(KINDS)}")
        if not self.temperature > 0:
            raise SmeltError(f"loss.temperature={self.temperature} must be > 0")
        if not 0 < self.skew_alpha < 1:
            raise SmeltError(f"loss.skew_alpha={self.skew_alpha} must be in (0, 1)")
        if self.ce_weight < 0:
            raise SmeltError(f"loss.ce_weight={self.ce_weight} must be >= 0")
        if self.kd_weight < 0 or self.kd_weight == self.ce_weight == 0:
            raise SmeltError(f"loss.kd_weight={self.kd_weight} must be >= 0, and > 0 unless ce_weight > 0")
        if self.chunk_tokens < 0:
            raise SmeltError(f"loss.chunk_tokens={self.chunk_tokens} must be >= 0 (0: by device)")
        if self.tail_weight < 0:
            raise SmeltError(f"loss.tail_weight={self.tail_weight} must be >= 0")
        if not 0 < self.tail_quantile < 1:
            raise SmeltError(f"loss.tail_quantile={self.tail_quantile} must be in (0, 1)")
        if self.hidden_kind not in HIDDEN_KINDS:
            raise SmeltError(f"loss.hidden_kind={self.hidden_kind!r} is not one of {', '.join(HIDDEN_KINDS)}")
        if self.hidden_weight < 0 or (self.hidden_weight > 0) != bool(self.hidden_keys):
            raise SmeltError(f"loss.hidden_weight={self.hidden_weight} must be >= 0, and > 0 exactly when "
                             f"loss.hidden_layers names blocks (got {self.hidden_layers!r})")


class DistillLoss(nn.Module):
    """Mean over (non-ignored) tokens of the configured divergence (tail tokens weighted
    1 + tail_weight) times kd_weight, plus ce_weight * CE.

    forward(student_logits [..., V], teacher_logits [..., V] or a cached TeacherTopK [..., k], labels [...]
    or None) ->
    (loss, {"kd": mean divergence, "ce": mean CE (if ce_weight > 0)}).
    """

    def __init__(self, cfg: DistillLossConfig | None = None):
        super().__init__()
        self.cfg = cfg or DistillLossConfig()

    def forward(self, student_logits: torch.Tensor, teacher_logits: torch.Tensor | TeacherTopK,
                labels: torch.Tensor | None = None):
        v = student_logits.shape[-1]
        if isinstance(teacher_logits, TeacherTopK):
            t = teacher_logits.flatten()
            if t.ids.shape[0] != student_logits.numel() // v:
                raise SmeltError(f"cached teacher has {t.ids.shape[0]} positions, the student's batch "
                                 f"{student_logits.numel() // v}")
        elif student_logits.shape[-1] != teacher_logits.shape[-1]:
            raise SmeltError(f"student vocab {student_logits.shape[-1]} != teacher vocab "
                             f"{teacher_logits.shape[-1]}")
        else:
            t = teacher_logits.detach().reshape(-1, v)
        s = student_logits.reshape(-1, v)
        lab = labels.reshape(-1) if labels is not None else None
        n_tok = (lab != -100).sum().clamp_min(1) if lab is not None else torch.tensor(s.shape[0])
        c = self.cfg
        chunk = c.chunk_tokens or chunk_tokens(s.device.type)
        total, kd, ce = _ChunkedLoss.apply(s, t, lab, c.kind, c.temperature, c.skew_alpha, c.ce_weight,
                                           chunk, c.tail_quantile, c.tail_weight, c.kd_weight)
        n_tok = n_tok.to(total.device, total.dtype)
        return total / n_tok, {"kd": (kd / n_tok).detach(), "ce": (ce / n_tok).detach()}
