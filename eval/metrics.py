"""Per-token comparison of a model with its teacher: the pure maths of the evaluation core.

All functions take flattened [tokens, vocab] inputs and work through them in chunks of tokens, so the
fp32 [tokens x vocab] probabilities (vocab 49k-128k) are never all materialised at once.
"""
from __future__ import annotations

import math

import torch

from core.kl import chunk_tokens, kl_rows

# Probabilities at which each bucket's per-token KL quantiles are stored: the distribution (CDF) the report
# draws, with the tail resolved finely, since compression damage concentrates in few tokens.
KL_CDF_P = [round(i / 100, 2) for i in range(1, 100)] + [0.995, 0.999]


@torch.no_grad()
def per_token_stats(logits: torch.Tensor, teacher_logprobs: torch.Tensor, targets: torch.Tensor,
                    chunk: int | None = None) -> dict[str, torch.Tensor]:
    """Per-token KL(teacher || model) over the full vocabulary, model NLL, teacher NLL, top-1 agreement.

    logits: [N, V] model logits (any float dtype); teacher_logprobs: [N, V] log-softmax of the teacher;
    targets: [N] next-token ids. Returns fp32/bool tensors of shape [N].
    """
    n = logits.shape[0]
    chunk = chunk or chunk_tokens(logits.device.type)
    if teacher_logprobs.shape != logits.shape:
        raise ValueError(f"teacher log-probs {tuple(teacher_logprobs.shape)} and model logits "
                         f"{tuple(logits.shape)} differ in shape (vocab mismatch?)")
    kl, nll, t_nll = torch.empty(n), torch.empty(n), torch.empty(n)
    agree = torch.empty(n, dtype=torch.bool)
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        lp = torch.log_softmax(logits[s:e].float(), dim=-1)
        tlp = teacher_logprobs[s:e].float()
        # Renormalise the (possibly fp16-cached) teacher log-probs so KL(t||t) is exactly 0.
        tlp = tlp - torch.logsumexp(tlp, dim=-1, keepdim=True)
        kl[s:e] = kl_rows(tlp, lp).clamp_min(0.0)
        tgt = targets[s:e].unsqueeze(-1)
        nll[s:e] = -lp.gather(-1, tgt).squeeze(-1)
        t_nll[s:e] = -tlp.gather(-1, tgt).squeeze(-1)
        agree[s:e] = lp.argmax(-1) == tlp.argmax(-1)
    return {"kl": kl, "nll": nll, "teacher_nll": t_nll, "top1_agree": agree}


def summarize(stats: dict[str, torch.Tensor]) -> dict[str, float]:
    """Aggregate per-token stats: PPL, KL mean and tail quantiles, top-1 agreement."""
    kl = stats["kl"].double()
    q = torch.quantile(kl, torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64)).tolist()
    cdf = torch.quantile(kl, torch.tensor(KL_CDF_P, dtype=torch.float64)).tolist()
    return {
        "tokens": int(kl.numel()),
        "ppl": math.exp(stats["nll"].double().mean().item()),
        "teacher_ppl": math.exp(stats["teacher_nll"].double().mean().item()),
        "kl_mean": kl.mean().item(),
        "kl_p50": q[0],
        "kl_p90": q[1],
        "kl_p99": q[2],
        "kl_max": kl.max().item(),
        "top1_agree": stats["top1_agree"].double().mean().item(),
        "kl_cdf": {"p": KL_CDF_P, "kl": [float(f"{v:.6g}") for v in cdf]},
    }


def cat_stats(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
