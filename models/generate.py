"""Sampling from the one model definition with its KV cache; self-speculative decoding with MTP heads
reuses the same cache (`KVCache.truncate` rolls back rejected drafts) and `next_token`."""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch import nn

from models.llama import Transformer

SMALL_M = 4  # rows up to which small_m_linears computes W @ xᵀ: at 2-4 rows within 3% of F.linear or faster on
# SmolLM2's shapes (1 row is a gemv either way)
WIDE_OUT = 8192  # ... and a 1-row input to a layer this wide (the output head, a restricted draft head) goes as
# 2 rows: a CPU gemv streams such weights at half the speed of a 2-column gemm (the [49152, 576] head 10.4
# against 4.1 ms, [8192, 576] 1.76 against 0.86 ms; at [4096, 576] the gemv wins, 0.33 against 0.40 ms:
# scripts/bench_small_m_linear.py, results/bench/mtp/small-m-linear.json and small-m-linear-draft-heads.json)


def _small_m_forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    if rows > SMALL_M:
        return F.linear(x, module.weight, module.bias)
    x2 = x.reshape(rows, x.shape[-1])
    if rows == 1 and module.out_features >= WIDE_OUT:
        y = (module.weight @ torch.cat([x2, x2]).T)[:, :1].T  # contiguous: an expand()ed operand was slower
    else:
        y = (module.weight @ x2.T).T
    if module.bias is not None:
        y = y + module.bias
    return y.reshape(*x.shape[:-1], module.out_features)


@contextlib.contextmanager
def small_m_linears(*roots: nn.Module):
    """Inside this block the fp32 nn.Linear layers on a CPU under `roots` compute inputs of up to SMALL_M
    rows as (W @ xᵀ)ᵀ instead of x @ Wᵀ: the same products, summed in another order.

    Why: decoding feeds a Linear 1 to gamma + 1 rows, and some CPUs' BLAS (MKL on this AMD EPYC) take the
    x @ Wᵀ path at a cost proportional to the rows, while W @ xᵀ costs the output head less at 2 rows than
    either path at one (README, issue 13). Packed or quantized layers (other classes), GPU and bf16 layers keep their
    own path. Restores every layer's forward on exit.
    """
    patched = list({id(m): m for root in roots for m in root.modules()  # a module shared by roots: once
                    if type(m) is nn.Linear and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32
                    and "forward" not in m.__dict__}.values())
    for m in patched:
        m.forward = functools.partial(_small_m_forward, m)
    try:
        yield len(patched)
    finally:
        for m in patched:
            del m.forward


def next_token(logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0,
               allowed: torch.Tensor | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Sample one token per row from logits [B, V]; temperature 0 is greedy.

    top_p keeps the smallest set of most likely tokens whose probability reaches top_p (nucleus);
    `allowed` [V] bool restricts the choice to a token subset (renormalised over it).
    """
    if not temperature >= 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 = greedy)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} must be in (0, 1]")
    if allowed is not None and not bool(allowed.any()):
        raise ValueError("allowed token set is empty")
    logits = logits.float()
    if allowed is not None:
        logits = logits.masked_fill(~allowed.to(logits.device), float("-inf"))
    if temperature == 0:
        return logits.argmax(-1)
    probs = (logits / temperature).softmax(-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p >= top_p  # the top token is always kept
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def sample(model: Transformer, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
           top_p: float = 1.0, first_allowed: torch.Tensor | None = None,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """Continue equal-length prompts [B, P] by max_new_tokens sampled tokens -> [B, P + max_new_tokens].

    Rows keep going past an end-of-sequence token (callers cut there): every row costs the same and
    the batch stays rectangular. `first_allowed` restricts only the first sampled token.
    """
    if prompt.ndim != 2 or prompt.shape[1] == 0:
        raise ValueError(f"prompt must be [batch, length>=1] token ids, got shape {tuple(prompt.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    total, limit = prompt.shape[1] + max_new_tokens, model.cfg.max_seq_len
    if total > limit:
        raise ValueError(f"prompt length {prompt.shape[1]} + max_new_tokens={max_new_tokens} exceeds the "
                         f"model's max_seq_len={limit}")
    was_training = model.training
    out = [prompt]
    try:
        model.eval()
        cache = model.new_cache(prompt.shape[0], total)
        # Only the last position's logits are needed: the output head over the whole prompt is ~20% of a
        # prefill's work (and a [B, P, vocab] tensor).
        logits = model.output(model.hidden_states(prompt, cache)[:, -1])
        for i in range(max_new_tokens):
            tok = next_token(logits, temperature, top_p, first_allowed if i == 0 else None, generator)
            out.append(tok[:, None])
            if i + 1 < max_new_tokens:
                logits = model(tok[:, None], cache)[:, -1]
    finally:
        model.train(was_training)
    return torch.cat(out, dim=1)

