"""Sampling from the one model definition with its KV cache; self-speculative decoding with MTP heads
reuses the same cache (`KVCache.truncate` rolls back rejected drafts) and `next_token`."""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.llama import Transformer

SMALL_M = 4  # rows up to which small_m_linears picks each product's form (decoding feeds 1 to gamma + 1 rows)
WIDE_OUT = 8192  # a 1-row input may go as 2 rows ("mv_t2") to a layer at least this wide (the output head, a
# restricted draft head): on the AMD EPYC a gemv streamed the [49152, 576] head at half the speed of a
# 2-column gemm (10.4 against 4.1 ms; results/bench/mtp/small-m-linear.json)
PATHS = ("linear", "mv_t", "mv_t2")  # F.linear (x @ Wᵀ); (W @ xᵀ)ᵀ; one row as two through W @ xᵀ
# Another form replaces F.linear only when its median is at most this share of F.linear's: on a near tie the pick
# would follow timing noise, and the forms round differently, so two runs could decode by different products.
MIN_GAIN = 0.95


def _product(path: str, weight: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    """x2 [rows, in] times weightᵀ by one of PATHS: the same products, summed in another order."""
    if path == "linear":
        return F.linear(x2, weight)
    if path == "mv_t":
        return (weight @ x2.T).T
    return (weight @ torch.cat([x2, x2]).T)[:, :1].T  # contiguous: an expand()ed operand was slower


def _candidates(out_features: int, rows: int) -> tuple[str, ...]:
    return PATHS if rows == 1 and out_features >= WIDE_OUT else PATHS[:2]


@torch.no_grad()
def tune_small_m(weights: list[torch.Tensor], repeats: int = 15) -> dict[tuple[int, int, int], str]:
    """The fastest of PATHS, timed here, for each weight shape and each row count 1..SMALL_M: {(out, in,
    rows): path}. Which form wins depends on the CPU's BLAS: on the AMD EPYC (W @ xᵀ)ᵀ at 2 rows cost the
    same as F.linear at one while F.linear doubled; on the Intel Xeon (AMX) F.linear at 2 rows costs less
    than at one on the block shapes and (W @ xᵀ)ᵀ 2.4-4.9 times more (results/bench/mtp/small-m-linear{,-xeon}.json).
    Cases run interleaved, after one warm-up call each; the fastest median wins if it beats F.linear's by
    MIN_GAIN, else F.linear stays. The inputs come from a local generator: the global RNG is not touched."""
    from core.device import interleaved_seconds  # the ground floor; kept local, like the tuning itself

    plan, gen = {}, torch.Generator().manual_seed(0)
    for w in {tuple(w.shape): w for w in weights}.values():
        out_features, in_features = w.shape
        for rows in range(1, SMALL_M + 1):
            x2 = torch.randn(rows, in_features, generator=gen).to(w.dtype)
            cases = {p: functools.partial(_product, p, w, x2) for p in _candidates(out_features, rows)}
            interleaved_seconds(cases, 1)
            times, _ = interleaved_seconds(cases, repeats)
            plan[(out_features, in_features, rows)] = pick_path({p: sorted(t)[repeats // 2] for p, t in times.items()})
    return plan


def pick_path(medians: dict[str, float]) -> str:
    """The form to use given each form's median seconds: the fastest, if it beats F.linear by MIN_GAIN."""
    best = min(medians, key=medians.get)
    return best if medians[best] <= MIN_GAIN * medians["linear"] else "linear"


def _small_m_forward(module: nn.Linear, plan: dict, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    if rows > SMALL_M:
        return F.linear(x, module.weight, module.bias)
    y = _product(plan.get((*module.weight.shape, rows), "linear"), module.weight, x.reshape(rows, x.shape[-1]))
    if module.bias is not None:
        y = y + module.bias
    return y.reshape(*x.shape[:-1], module.out_features)


@dataclass
class SmallM:
    layers: int                              # nn.Linear layers patched
    plan: dict[tuple[int, int, int], str]    # (out, in, rows) -> the path taken

    def record(self) -> dict[str, dict[str, str]]:
        """The plan as JSON: {"OUTxIN": {"rows": path}}."""
        out: dict[str, dict[str, str]] = {}
        for (o, i, rows), path in sorted(self.plan.items()):
            out.setdefault(f"{o}x{i}", {})[str(rows)] = path
        return out


@contextlib.contextmanager
def small_m_linears(*roots: nn.Module, plan: dict[tuple[int, int, int], str] | None = None):
    """Inside this block the fp32 nn.Linear layers on a CPU under `roots` compute inputs of up to SMALL_M
    rows by the form `plan` names for their shape and row count (default: tune_small_m's choice on this
    machine, for these layers; F.linear where the plan is silent). Yields a SmallM.

    Why: decoding feeds a Linear 1 to gamma + 1 rows, and CPUs' BLAS libraries differ by factors of 2-5 on
    which form of so few rows is fast (docs/mtp.md). Packed or quantized layers (other classes), GPU
    and bf16 layers keep their own path. Restores every layer's forward on exit.
    """
    patched = list({id(m): m for root in roots for m in root.modules()  # a module shared by roots: once
                    if type(m) is nn.Linear and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32
                    and "forward" not in m.__dict__}.values())
    plan = tune_small_m([m.weight for m in patched]) if plan is None else plan
    bad = {k: v for k, v in plan.items() if v not in _candidates(k[0], k[2])}
    if bad:
        raise ValueError(f"small_m_linears plan: {bad} is not one of {PATHS} (mv_t2 only at one row, >= {WIDE_OUT} wide)")
    for m in patched:
        m.forward = functools.partial(_small_m_forward, m, plan)
    try:
        yield SmallM(len(patched), plan)
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

