"""Self-speculative decoding: the model's own MTP modules draft, the model verifies, the output is exact.

Each round (batch 1), with N tokens in the main model's KV cache and the next token x_N already chosen:
1. draft: module k (k = 1..gamma) reads its level-(k-1) hidden state at position N-1 and the embedding of
   the token k places ahead (x_N, then the drafts d_1..d_{k-1}) and proposes d_k ~ q_k;
2. verify: one main-model forward over [x_N, d_1..d_gamma] gives p_0..p_gamma;
3. accept d_j while u < p_{j-1}(d_j) / q_j(d_j) (u uniform); at the first rejection draw the next token
   from norm(max(0, p_{j-1} - q_j)); if all are accepted draw it from p_gamma. Temperature 0 is the
   greedy case: accept while d_j equals argmax p_{j-1}, and the next token is that argmax.
This is speculative sampling (Leviathan et al. 2023; Chen et al. 2023): every token has exactly the main
model's distribution, and greedy output equals plain greedy decoding token for token.

Drafting may read a restricted head (`DraftVocab`: the output head's rows for a frequent-token subset, as
FR-Spec does, Zhao et al. 2025): q is then zero outside the subset, which the rule above already handles
exactly; only the draft's cost and its acceptance change.

Rollback: the main cache is truncated to the accepted tokens; level k's cache and hidden states at
position i were computed from token i + k, so they survive while that token was accepted (i + k <= N + a).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from core.errors import SmeltError
from models.generate import next_token
from models.llama import Transformer
from models.mtp import MTPHeads


def acceptance_summary(accepted: list[int], gamma: int) -> dict:
    """From the drafts accepted per round: alpha (the first draft's acceptance rate), accepted drafts per
    round, tokens per main-model forward, and the i.i.d. prediction (1 - alpha^(gamma+1)) / (1 - alpha)."""
    n = max(len(accepted), 1)
    alpha = sum(a >= 1 for a in accepted) / n
    return {"rounds": len(accepted), "alpha_first": alpha, "mean_accepted": sum(accepted) / n,
            "tokens_per_forward": 1 + sum(accepted) / n, "gamma": gamma,
            "predicted_tokens_per_forward": (1 - alpha ** (gamma + 1)) / (1 - alpha) if alpha < 1 else gamma + 1}


def alpha_standard_error(accepted_per_prompt: list[list[int]]) -> float | None:
    """Standard error of alpha (first drafts accepted / rounds) when the rounds come in prompts: the rounds of
    one prompt are not independent (a repetitive continuation accepts nearly everything), so the error is the
    ratio estimator's, clustered by prompt, sqrt(n / (n - 1) * sum_i (a_i - alpha r_i)^2) / sum_i r_i, with a_i
    the first drafts accepted and r_i the rounds of prompt i. None below two prompts."""
    groups = [g for g in accepted_per_prompt if g]
    if len(groups) < 2:
        return None
    a = [sum(x >= 1 for x in g) for g in groups]
    r = [len(g) for g in groups]
    alpha = sum(a) / sum(r)
    n = len(groups)
    return math.sqrt(n / (n - 1) * sum((ai - alpha * ri) ** 2 for ai, ri in zip(a, r))) / sum(r)


class DraftVocab(nn.Module):
    """The output head's rows for a token subset, used only to draft: a draft step's head then costs
    len(ids) / vocab of the full head's, which dominates a one-block MTP module's step on a CPU."""

    def __init__(self, head: nn.Module, ids: torch.Tensor):
        super().__init__()
        weight = getattr(head, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.ndim != 2:
            raise SmeltError(f"draft vocabulary: the output head ({type(head).__name__}) has no [vocab, dim] weight")
        vocab = weight.shape[0]
        ids = torch.as_tensor(ids, dtype=torch.long).flatten()
        if len(ids) == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise SmeltError(f"draft vocabulary: {len(ids)} ids must be non-empty and within [0, {vocab})")
        if len(ids.unique()) != len(ids):
            raise SmeltError("draft vocabulary: the ids must be distinct")
        self.vocab = vocab
        self.register_buffer("ids", ids.to(weight.device), persistent=False)
        bias = getattr(head, "bias", None)
        self.head = nn.Linear(weight.shape[1], len(ids), bias=bias is not None, device=weight.device,
                              dtype=weight.dtype)
        with torch.no_grad():
            self.head.weight.copy_(weight[self.ids])
            if bias is not None:
                self.head.bias.copy_(bias[self.ids])
        self.head.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits over the subset, in the order of `ids`."""
        return self.head(x)


def frequent_token_ids(tokens: torch.Tensor, n: int, vocab_size: int) -> torch.Tensor:
    """The n most frequent ids of a token stream (ties: the lower id), most frequent first; ids that never
    occur fill the rest in id order, so any n <= vocab_size gives n distinct ids."""
    if not 1 <= n <= vocab_size:
        raise SmeltError(f"draft vocabulary size {n} must be within [1, {vocab_size}] (the vocabulary)")
    tokens = tokens.flatten()
    if tokens.numel() and not 0 <= int(tokens.min()) <= int(tokens.max()) < vocab_size:
        raise SmeltError(f"draft vocabulary: the token stream holds ids outside [0, {vocab_size})")
    return torch.argsort(-torch.bincount(tokens, minlength=vocab_size), stable=True)[:n]


@dataclass
class SpecStats:
    accepted: list[int] = field(default_factory=list)  # drafts accepted per round (one verification each)
    drafted: list[list[int]] = field(default_factory=list)  # the round's drafts, d_1..d_gamma

    @property
    def rounds(self) -> int:
        return len(self.accepted)

    def summary(self, gamma: int) -> dict:
        return acceptance_summary(self.accepted, gamma)


def _probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return (logits.float() / temperature).softmax(-1)


@torch.no_grad()
def speculative_generate(model: Transformer, heads: MTPHeads, prompt: torch.Tensor, max_new_tokens: int,
                         gamma: int = 1, temperature: float = 0.0,
                         generator: torch.Generator | None = None,
                         draft_vocab: DraftVocab | None = None) -> tuple[torch.Tensor, SpecStats]:
    """Continue prompt [1, P] by exactly max_new_tokens tokens -> ([1, P + max_new_tokens], stats).
    `draft_vocab`: draft from that token subset (DraftVocab) instead of the whole head."""
    if gamma < 1:
        raise SmeltError(f"gamma={gamma} must be >= 1 (drafted tokens per round)")
    if gamma > heads.depth:
        raise SmeltError(f"gamma={gamma} exceeds the MTP depth {heads.depth} (module k drafts the token k ahead)")
    if prompt.ndim != 2 or prompt.shape[0] != 1 or prompt.shape[1] == 0:
        raise SmeltError(f"prompt must be [1, length>=1] token ids, got shape {tuple(prompt.shape)}")
    if max_new_tokens < 1:
        raise SmeltError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if not temperature >= 0:
        raise SmeltError(f"temperature={temperature} must be >= 0 (0 = greedy)")
    if draft_vocab is not None and draft_vocab.vocab != model.cfg.vocab_size:
        raise SmeltError(f"draft vocabulary built for {draft_vocab.vocab} tokens; the model has {model.cfg.vocab_size}")
    P = prompt.shape[1]
    max_len = P + max_new_tokens + gamma + 1
    if max_len > model.cfg.max_seq_len:
        raise SmeltError(f"prompt length {P} + {max_new_tokens} new tokens + gamma {gamma} + 1 exceeds the model's "
                         f"max_seq_len={model.cfg.max_seq_len}")
    stats = SpecStats()
    device = model.tok_embeddings.weight.device
    cache, mcache = model.new_cache(1, max_len), heads.new_cache(1, max_len)
    dim = model.cfg.dim
    # hidden states per level: the main model's (0; with fused layers, [h^0; r_a; ...]), then module k's
    hs = [torch.zeros(1, max_len, dim * (1 + len(heads.fuse_layers) if k == 0 else 1), device=device,
                      dtype=model.tok_embeddings.weight.dtype) for k in range(gamma + 1)]
    count = [0] * (gamma + 1)       # filled positions per level (level k: its cache's length too)
    seq = prompt[0].tolist()

    h, x0 = heads.level0(model, prompt.to(device), cache)
    hs[0][:, :P], count[0] = x0, P
    seq.append(int(next_token(model.output(h[:, -1]), temperature, generator=generator)))
    while len(seq) - P < max_new_tokens:
        N = count[0]                # seq[N] is chosen, not yet in the main cache
        drafts, q = [], []
        for k in range(1, gamma + 1):
            c, module = count[k], heads.mtp[k - 1]
            toks = torch.tensor([(seq + drafts)[c + k:N + k]], device=device)
            out = module(hs[k - 1][:, c:N], model.tok_embeddings(toks), model.rope_cos[c:N], model.rope_sin[c:N],
                         mcache[k - 1])
            hs[k][:, c:N], count[k] = out, N
            x = module.norm(out[:, -1])
            if draft_vocab is None:
                logits = model.output(x)[0]
                d = int(next_token(logits[None], temperature, generator=generator))
                q.append(None if temperature == 0 else _probs(logits, temperature))
            else:
                logits = draft_vocab(x)[0]
                d = int(draft_vocab.ids[next_token(logits[None], temperature, generator=generator)[0]])
                q.append(None if temperature == 0 else torch.zeros(
                    draft_vocab.vocab, device=logits.device).index_copy_(0, draft_vocab.ids, _probs(logits, temperature)))
            drafts.append(d)
        h, x0 = heads.level0(model, torch.tensor([[seq[N], *drafts]], device=device), cache)
        logits = model.output(h)[0]  # [gamma + 1, V]: p_j predicts the token after position N + j
        a, nxt = 0, None
        for j, d in enumerate(drafts):
            if temperature == 0:
                best = int(logits[j].argmax())
                if best == d:
                    a += 1
                    continue
                nxt = best
                break
            p = _probs(logits[j], temperature)
            u = float(torch.rand((), generator=generator))  # on the CPU: the generator's device
            if u * float(q[j][d]) < float(p[d]):  # accept with probability min(1, p/q)
                a += 1
                continue
            resid = (p - q[j]).clamp_min(0)
            nxt = int(torch.multinomial(resid / resid.sum(), 1, generator=generator))
            break
        if nxt is None:             # every draft accepted: the bonus token from p_gamma
            nxt = int(next_token(logits[gamma][None], temperature, generator=generator))
        seq += drafts[:a] + [nxt]
        stats.accepted.append(a)
        stats.drafted.append(drafts)
        keep = N + 1 + a            # main positions now verified
        for c in cache.values():
            c.truncate(keep)
        hs[0][:, N:keep], count[0] = x0[:, :a + 1], keep
        for k in range(1, gamma + 1):  # level k at position i used token i + k: valid while i + k <= N + a
            count[k] = min(count[k], N + a - k + 1)
            mcache[k - 1].truncate(count[k])
    return torch.tensor([seq[:P + max_new_tokens]]), stats


def acceptance_probe(model: Transformer, heads: MTPHeads, prompts: list[list[int]], new_tokens: int,
                     gamma: int = 1) -> dict:
    """Greedy self-speculative decoding of fixed prompts: what a release records about its MTP modules and
    its verifier re-measures (deterministic given the weights, up to floating-point ties)."""
    accepted = []
    for ids in prompts:
        accepted += speculative_generate(model, heads, torch.tensor([ids]), new_tokens, gamma=gamma)[1].accepted
    return {**acceptance_summary(accepted, gamma), "new_tokens": new_tokens}
