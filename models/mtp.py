"""Multi-token prediction (MTP) modules, DeepSeek-V3 style, for the one Llama model.

Module k (1-based) sees, at position i, the previous level's hidden state h^{k-1}_i (h^0: the main
model's final-norm hidden state, what its output head reads) and the embedding of token t_{i+k}:

    h'_i = proj([hnorm(h^{k-1}_i); enorm(Emb(t_{i+k}))])      proj: 2d -> d, no bias
    h^k  = Block_k(h'), one transformer block of the main model's shape (causal, RoPE at position i)
    P(t_{i+k+1}) = softmax(Head(norm_k(h^k_i)))                Emb and Head shared with the main model

so module k predicts k+1 tokens ahead and modules chain sequentially. The embedding and output head
belong to the main model (tied in SmolLM2); the MTP file holds only the modules' own weights, under
`mtp.<k-1>.{hnorm,enorm,proj,block.*,norm}` (docs/release-format.md).
"""
from __future__ import annotations

import torch
from torch import nn

from core.errors import SmeltError
from models.llama import KVCache, LlamaConfig, RMSNorm, Transformer, TransformerBlock

MTP_FILE = "mtp.safetensors"


class MTPModule(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.hnorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.enorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.proj = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        self.block = TransformerBlock(cfg)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, h_prev: torch.Tensor, emb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | None = None) -> torch.Tensor:
        """h_prev, emb [B, L, d] at the same positions -> this level's hidden states [B, L, d]."""
        x = self.proj(torch.cat([self.hnorm(h_prev), self.enorm(emb)], dim=-1))
        return self.block(x, cos, sin, cache)


class MTPHeads(nn.Module):
    """`depth` sequential MTP modules; they borrow the main model's embedding and output head."""

    def __init__(self, cfg: LlamaConfig, depth: int = 1):
        super().__init__()
        if depth < 1:
            raise SmeltError(f"mtp depth={depth} must be >= 1")
        self.cfg = cfg
        self.mtp = nn.ModuleList(MTPModule(cfg) for _ in range(depth))

    @property
    def depth(self) -> int:
        return len(self.mtp)

    def init_weights(self, seed: int | None = 0, std: float = 0.02) -> None:
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.ones_like(p) if p.dim() == 1 else torch.randn(p.shape, generator=gen) * std)

    def forward(self, trunk: Transformer, h0: torch.Tensor, tokens: torch.Tensor) -> list[torch.Tensor]:
        """Teacher-forced logits of every module: h0 [B, T, d] (trunk.hidden_states(tokens)), tokens [B, T].

        Returns [logits_k for k = 1..depth], logits_k [B, T - k, V]: row i predicts t_{i+k+1} (the last
        row of each predicts past the window; losses drop it)."""
        T = tokens.shape[1]
        if T <= self.depth:
            raise SmeltError(f"mtp depth {self.depth} needs windows longer than {self.depth} tokens, got {T}")
        h, out = h0, []
        for k, module in enumerate(self.mtp, start=1):
            n = T - k
            h = module(h[:, :n], trunk.tok_embeddings(tokens[:, k:k + n]), trunk.rope_cos[:n], trunk.rope_sin[:n])
            out.append(trunk.output(module.norm(h)))
        return out

    def new_cache(self, batch: int, max_len: int) -> list[KVCache]:
        w = self.mtp[0].block.attention.wk.weight
        return [KVCache(batch, self.cfg.n_kv_heads, self.cfg.head_dim, max_len, w.dtype, w.device)
                for _ in self.mtp]


def check_compatible(heads: MTPHeads, trunk: Transformer) -> None:
    """The MTP modules must have the main model's block shape (they share its embedding and head)."""
    a, b = heads.cfg, trunk.cfg
    keys = ("dim", "n_heads", "n_kv_heads", "head_dim", "ffn_hidden", "vocab_size")
    diff = [k for k in keys if getattr(a, k) != getattr(b, k)]
    if diff:
        raise SmeltError(f"{MTP_FILE}: its modules were built for {diff[0]}={getattr(a, diff[0])}, the main model "
                         f"has {getattr(b, diff[0])}")
