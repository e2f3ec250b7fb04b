"""The one model definition every stage uses: a Llama-family decoder.

RMSNorm, RoPE (HF "rotate-half" layout, configurable theta), grouped-query attention (optionally with
q/k/v biases, as Qwen2, and a sliding window, as Mistral), SwiGLU MLP, tied or untied embeddings. Parameter names follow torchtitan's llama3 model (tok_embeddings,
layers.{i}.attention.wq, feed_forward.w1, norm, output) so torchtitan's FSDP2 / activation-checkpoint
helpers apply unchanged, and `models.hf_io` maps them to and from Hugging Face names.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from core.errors import SmeltError


@dataclass
class LlamaConfig:
    dim: int = 576
    n_layers: int = 30
    n_heads: int = 9
    n_kv_heads: int = 3
    vocab_size: int = 49152
    ffn_hidden: int = 1536
    head_dim: int | None = None  # None: dim // n_heads
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # Llama 3.1 "llama3" scaling: factor, low/high_freq_factor, original len
    max_seq_len: int = 2048
    tie_embeddings: bool = True
    bos_id: int | None = None
    eos_id: int | None = None
    qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2)
    sliding_window: int | None = None  # each position attends to the last `sliding_window` positions (Mistral)
    model_type: str = "llama"  # the Hugging Face architecture config.json is written as (models.hf_io)

    def __post_init__(self):
        if self.head_dim is None:
            if self.dim % self.n_heads:
                raise ValueError(f"dim={self.dim} is not a multiple of n_heads={self.n_heads}")
            self.head_dim = self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window={self.sliding_window} must be >= 1")

    @classmethod
    def from_dict(cls, d: dict) -> LlamaConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown model config key(s): {', '.join(unknown)}")
        return cls(**d)

    def to_dict(self) -> dict:
        return asdict(self)


# Tiny flavors make every feature runnable on a laptop CPU; "smollm2-135m" is the default teacher.
FLAVORS: dict[str, LlamaConfig] = {
    "debug": LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_hidden=128,
                         max_seq_len=256, tie_embeddings=True),
    "debug-untied": LlamaConfig(dim=64, n_layers=3, n_heads=4, n_kv_heads=1, vocab_size=256,
                                ffn_hidden=192, max_seq_len=256, tie_embeddings=False,
                                rope_theta=500000.0),
    "smollm2-135m": LlamaConfig(),
    # the cluster recipe's teacher shape (memory measurements with random weights; the weights come from the hub)
    "llama3.1-8b": LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_hidden=14336,
                               rope_theta=500000.0, max_seq_len=131072, tie_embeddings=False, bos_id=128000,
                               eos_id=128009, rope_scaling={"factor": 8.0, "low_freq_factor": 1.0,
                                                            "high_freq_factor": 4.0,
                                                            "original_max_position_embeddings": 8192}),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 as HF does, then cast back before the gain (bf16 training stays stable).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def reset_parameters(self):
        nn.init.ones_(self.weight)


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's long-context RoPE: wavelengths longer than original_len / low_freq_factor are divided by
    `factor`, shorter than original_len / high_freq_factor kept, and the band between interpolated."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= original / low) & (wavelen >= original / high)
    return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)


def rope_cache(head_dim: int, max_seq_len: int, theta: float, scaling: dict | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling:
        inv_freq = llama3_inv_freq(inv_freq, scaling)
    t = torch.arange(max_seq_len, dtype=torch.float64)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().float(), emb.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, H, L, D]; cos/sin: [L, D]. "Rotate-half" layout, the one HF checkpoints use.
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rot * sin).to(x.dtype)


def window_mask(start: int, new: int, total: int, window: int | None, device) -> torch.Tensor | None:
    """Which keys [0, total) the queries at positions [start, start + new) see: bool [new, total], key j
    visible from position p when j <= p and, with a sliding window, p - j < window (HF's convention).
    None where plain causal attention over all of them is exactly that (SDPA's fused is_causal path)."""
    if (window is None or total <= window) and start == 0:
        return None
    mask = torch.ones(new, total, dtype=torch.bool, device=device).tril(diagonal=start)
    return mask.triu(diagonal=start - window + 1) if window is not None and total > window else mask


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.window = cfg.sliding_window
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        # Set by head-scoring tools: when True, forward stores the attention probabilities
        # ([B, H, L, L]) on self.last_attn via the explicit (non-fused) path.
        self.capture_attn = False
        self.last_attn: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | None = None) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        q = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            if self.capture_attn:
                raise ValueError("capture_attn needs the full-sequence path (no KV cache)")
            return self.wo(cache.attend(q, k, v, self.window).transpose(1, 2).reshape(bsz, seqlen, -1))
        rep = self.n_heads // self.n_kv_heads
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        mask = window_mask(0, seqlen, seqlen, self.window, x.device)
        if self.capture_attn:
            scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(self.head_dim)
            if mask is None:
                mask = torch.ones(seqlen, seqlen, dtype=torch.bool, device=x.device).tril()
            probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
            self.last_attn = probs.detach()
            out = (probs @ v.float()).to(q.dtype)
        else:
            # SDPA has CPU and CUDA forward+backward kernels, so no CPU attention shim is needed.
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class KVCache:
    """One layer's keys/values for incremental decoding: [B, n_kv_heads, max_len, head_dim] buffers.

    `pos` is how many positions are filled. A call with L new tokens writes them at [pos, pos+L) and
    attends over [0, pos+L) with the causal offset, so one-token decoding, chunked prefill and
    multi-token verification (self-speculative decoding) share one path. `truncate(n)` rolls back
    rejected draft tokens.
    """

    static = False  # pos is a Python int (StaticKVCache: a device tensor)

    def __init__(self, batch: int, n_kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        self.k = torch.zeros(batch, n_kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.pos = 0

    def truncate(self, n: int) -> None:
        if not 0 <= n <= self.pos:
            raise ValueError(f"cannot truncate a KV cache holding {self.pos} positions to {n}")
        self.pos = n

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None) -> torch.Tensor:
        new, start = k.shape[2], self.pos
        if start + new > self.k.shape[2]:
            raise ValueError(f"KV cache overflow: {start + new} positions > max_len={self.k.shape[2]}")
        self.k[:, :, start:start + new] = k
        self.v[:, :, start:start + new] = v
        self.pos = start + new
        keys, values = self.k[:, :, :self.pos], self.v[:, :, :self.pos]
        # enable_gqa: query head h reads KV head h // rep from the cache in place, with the same results as
        # repeating the cache per query head, which copied all of it every step and at batch 64 (distill.self_text)
        # cost more than the step's attention (experiments/bench_decode_gqa.py; docs/mtp.md)
        gqa = q.shape[1] != keys.shape[1]
        # query i (absolute start + i) sees keys 0..start+i (the last `window` of them with a sliding window)
        mask = window_mask(start, new, self.pos, window, q.device)
        if mask is None and new > 1:  # a prefill: the fused causal kernel, no [L, L] mask (half the time at 2K)
            return F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=gqa)
        if new == 1 and (window is None or self.pos <= window):
            mask = None  # one new token sees every cached key
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=gqa)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)  # gate
        self.w2 = nn.Linear(hidden, dim, bias=False)  # down
        self.w3 = nn.Linear(dim, hidden, bias=False)  # up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class StaticKVCache(KVCache):
    """A KVCache whose every call has the same shapes and no host synchronisation, so a decode step can be
    captured once as a CUDA graph and replayed: `pos` is a 0-d device tensor advanced in place, the L new
    keys/values are written at [pos, pos + L) by index, and attention reads all max_len positions under a
    mask (causal, and the sliding window). Overflow is not checked (it would need the host to read pos): the
    caller sizes max_len."""
    static = True

    def __init__(self, batch: int, n_kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        super().__init__(batch, n_kv_heads, head_dim, max_len, dtype, device)
        self.pos = torch.zeros((), dtype=torch.long, device=device)
        self._keys = torch.arange(max_len, device=device)

    def positions(self, new: int) -> torch.Tensor:
        """The absolute positions [pos, pos + new) of the next call's tokens, on the device."""
        return self.pos + self._keys[:new]

    def truncate(self, n: int) -> None:
        self.pos.fill_(n)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None) -> torch.Tensor:
        at = self.positions(k.shape[2])
        self.k.index_copy_(2, at, k)
        self.v.index_copy_(2, at, v)
        mask = self._keys[None, :] <= at[:, None]  # [new, max_len]: key j visible from position p when j <= p
        if window is not None:
            mask &= self._keys[None, :] > at[:, None] - window
        self.pos += k.shape[2]
        return F.scaled_dot_product_attention(q, self.k, self.v, attn_mask=mask, enable_gqa=q.shape[1] != self.k.shape[1])


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, cache)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        # A ModuleDict keyed by the original layer index keeps checkpoint names stable when depth
        # pruning removes layers (layers.7 stays layers.7), as torchtitan does.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.n_layers)})
        # Training switch (activation checkpointing): recompute each block in backward instead of keeping its
        # activations. A flag, not a wrapper module, so parameter and module names stay the checkpoint's.
        self.recompute_blocks = False
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_cache(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def init_weights(self, buffer_device: torch.device | None = None, seed: int | None = None):
        """Random init (tests and torchtitan's meta-device flow); real weights come from models.io."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        std = 0.02
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith(".bias"):
                    p.zero_()
                elif p.dim() == 1:
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
        self.init_rope(buffer_device)

    def init_rope(self, device: torch.device | str | None = None):
        """(Re)compute the RoPE tables; needed after building on the meta device."""
        cos, sin = rope_cache(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta,
                              self.cfg.rope_scaling)
        dev = device if device is not None else self.tok_embeddings.weight.device
        self.rope_cos, self.rope_sin = cos.to(dev), sin.to(dev)

    def new_cache(self, batch: int, max_len: int | None = None, static: bool = False) -> dict[str, KVCache]:
        """Empty per-layer KV caches for incremental decoding (see KVCache; static: StaticKVCache, for a decode
        step captured as a CUDA graph)."""
        max_len = self.cfg.max_seq_len if max_len is None else max_len
        if not 1 <= max_len <= self.cfg.max_seq_len:
            raise ValueError(f"cache max_len={max_len} must be in [1, max_seq_len={self.cfg.max_seq_len}]")
        w = self.tok_embeddings.weight  # activations (and so keys/values) are in its dtype; Linears may be packed
        kind = StaticKVCache if static else KVCache
        return {key: kind(batch, self.cfg.n_kv_heads, self.cfg.head_dim, max_len, w.dtype, w.device)
                for key in self.layers}

    def hidden_states(self, tokens: torch.Tensor, cache: dict[str, KVCache] | None = None) -> torch.Tensor:
        """Final-norm hidden states [B, L, dim] (MTP heads and chunked losses start from here).

        With `cache` (from new_cache), `tokens` continue the cached positions."""
        return self.hidden_states_and_taps(tokens, cache)[0]

    def hidden_states_and_taps(self, tokens: torch.Tensor, cache: dict[str, KVCache] | None = None,
                               taps: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """hidden_states, and the residual stream after each block whose index (0-based) is in `taps`, in
        the order of `taps` (what fused MTP modules read next to the final hidden state)."""
        first = next(iter(cache.values())) if cache else None
        if first is not None and first.static:  # positions on the device: no host sync, graph-safe
            at = first.positions(tokens.shape[1])
            cos, sin = self.rope_cos.index_select(0, at), self.rope_sin.index_select(0, at)
        else:
            start = first.pos if first is not None else 0
            end = start + tokens.shape[1]
            if end > self.rope_cos.shape[0]:
                raise ValueError(f"sequence length {end} exceeds max_seq_len={self.rope_cos.shape[0]}")
            cos, sin = self.rope_cos[start:end], self.rope_sin[start:end]
        h = self.tok_embeddings(tokens)
        recompute = self.recompute_blocks and cache is None and torch.is_grad_enabled()
        kept = {}
        for i, (key, layer) in enumerate(self.layers.items()):
            if recompute:
                h = checkpoint(layer, h, cos, sin, None, use_reentrant=False)
            else:
                h = layer(h, cos, sin, cache[key] if cache else None)
            if i in taps:
                kept[i] = h
        missing = [t for t in taps if t not in kept]
        if missing:
            raise SmeltError(f"mtp.fuse_layers: block {missing[0]} is not a block of this model "
                             f"(0..{len(self.layers) - 1}, by position in the saved model)")
        return self.norm(h), [kept[t] for t in taps]

    def forward(self, tokens: torch.Tensor, cache: dict[str, KVCache] | None = None) -> torch.Tensor:
        return self.output(self.hidden_states(tokens, cache))


def build_model(cfg: LlamaConfig, device: str | torch.device = "cpu", seed: int | None = 0) -> Transformer:
    with torch.device(device):
        model = Transformer(cfg)
    if str(device) != "meta":
        model.init_weights(seed=seed)
    return model


def skip_matches(name: str, entry: str) -> bool:
    """A skip entry matches a module by full name, as a dotted prefix ("layers.0") or suffix ("attention.wo")."""
    return name == entry or name.startswith(entry + ".") or name.endswith("." + entry)


DEFAULT_SKIP = ("output", "tok_embeddings")  # what compression stages leave alone unless told otherwise


def linear_names(model: nn.Module, skip: tuple[str, ...] = DEFAULT_SKIP, field: str = "skip") -> list[str]:
    """Names of the nn.Linear modules that compression stages act on: all but those `skip` matches.

    Every skip entry must match some module (a typo is an error naming `field`, not a silent no-op).
    """
    if isinstance(skip, str):
        raise SmeltError(f"{field} must be a list of module names, not the string {skip!r}")
    names = [n for n, _ in model.named_modules() if n]
    for entry in skip:
        if not any(skip_matches(n, entry) for n in names):
            raise SmeltError(f"{field}: {entry!r} matches no module of the model "
                             f"(names look like 'output', 'layers.0', 'attention.wq')")
    return [n for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and not any(skip_matches(n, e) for e in skip)]
