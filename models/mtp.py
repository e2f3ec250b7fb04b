"""Multi-token prediction (MTP) modules, DeepSeek-V3 style, for the one Llama model.

Module k (1-based) sees, at position i, the previous level's hidden state h^{k-1}_i (h^0: the main
model's final-norm hidden state, what its output head reads) and the embedding of token t_{i+k}:

    h'_i = proj([hnorm(h^{k-1}_i); enorm(Emb(t_{i+k}))])      proj: 2d -> d, no bias
    h^k  = Block_k(h'), one transformer block of the main model's shape (causal, RoPE at position i)
    P(t_{i+k+1}) = softmax(Head(norm_k(h^k_i)))                Emb and Head shared with the main model

so module k predicts k+1 tokens ahead and modules chain sequentially. The embedding and output head
belong to the main model (tied in SmolLM2); the MTP file holds only the modules' own weights, under
`mtp.<k-1>.{hnorm,enorm,proj,block.*,norm}` (docs/release-format.md).

Fused features (`fuse_layers`, off by default; EAGLE-3, Li et al. 2025): module 1 also reads the main model's
residual stream after some of its blocks, each under its own norm, appended to the projection's input:
proj([hnorm(h^0); enorm(e); fnorms.0(r_a); fnorms.1(r_b); ...]) : (2 + n) d -> d. The final hidden state is
shaped to predict the next token only; earlier layers still carry what the token after it needs. The extra
columns start at zero and the rest as the plain module's would (same seed, same draws), so a fused module
starts as the plain one, weight for weight. Level 0 is then the concatenation
[h^0; r_a; r_b; ...] (MTPHeads.level0), which speculative decoding keeps per position like h^0.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from core.dtensor import first_error, like, local, local_slices
from core.errors import SmeltError, one_line
from core.files import (
    atomic_save_safetensors,
    check_finite,
    open_safetensors,
    safetensors_metadata,
    sha256_file,
)
from models.llama import KVCache, LlamaConfig, RMSNorm, Transformer, TransformerBlock

MTP_FILE = "mtp.safetensors"
MTP_FORMAT = "smelt-mtp/1"
MTP_TARGETS = ("teacher", "main")


@dataclass(kw_only=True)
class MTPConfig:
    """MTP modules in the trainer (train.titan.SmeltModel.Config.mtp)."""

    depth: int = 0            # modules; 0: none (every stage but `mtp`)
    joint: bool = False       # also train the main model (its loss + weight * the MTP loss); default frozen
    weight: float = 1.0       # joint mode: weight of the MTP loss next to the main model's
    init: str = "last_block"  # a new module's block starts as a copy of the main model's last block, or "random"
    # What the KL term distils to, k tokens ahead: "teacher" (the run's --teacher), or "main": the frozen main
    # model's own distribution there. The main model is what verifies the drafts, so its distribution is the
    # one acceptance is judged against, and it costs no teacher forward (its logits come from h^0).
    target: str = "teacher"
    # EAGLE-style feature regression (Li et al. 2024): + weight x the normalised MSE between what the head reads
    # from module k at position i and what it reads from the main model at i + k. A dense 576-number target per
    # token next to the logit loss; a module whose features matched exactly would draft the main model's argmax.
    feature_weight: float = 0.0
    # Main-model blocks (0-based) whose output module 1 also reads (EAGLE-3's low/mid/high features); () none.
    fuse_layers: tuple[int, ...] = ()

    def __post_init__(self):
        if isinstance(self.fuse_layers, str) or not hasattr(self.fuse_layers, "__iter__"):
            raise SmeltError(f"mtp.fuse_layers={self.fuse_layers!r} must be a list of block indices, e.g. [2, 15, 27]")
        self.fuse_layers = tuple(self.fuse_layers)
        _check_fuse_layers(self.fuse_layers)
        if self.fuse_layers and not self.depth:
            raise SmeltError(f"mtp.fuse_layers={list(self.fuse_layers)} needs mtp.depth >= 1 (a module to read them)")
        if self.feature_weight < 0:
            raise SmeltError(f"mtp.feature_weight={self.feature_weight} must be >= 0")
        if self.depth < 0:
            raise SmeltError(f"mtp.depth={self.depth} must be >= 0")
        if not self.weight > 0:
            raise SmeltError(f"mtp.weight={self.weight} must be > 0")
        if self.init not in ("last_block", "random"):
            raise SmeltError(f"mtp.init={self.init!r} is not 'last_block' or 'random'")
        if self.target not in MTP_TARGETS:
            raise SmeltError(f"mtp.target={self.target!r} is not one of {', '.join(MTP_TARGETS)}")
        if self.target == "main" and self.joint:
            raise SmeltError("mtp.target='main' needs a frozen main model (mtp.joint=false): a main model that "
                             "trains would be chasing its own moving distribution")


def _check_fuse_layers(layers: tuple[int, ...], n_layers: int | None = None) -> None:
    not_index = any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in layers)  # True is no block
    if not_index or len(set(layers)) != len(layers):
        raise SmeltError(f"mtp.fuse_layers={list(layers)} must be distinct block indices >= 0")
    if n_layers is not None and any(i >= n_layers for i in layers):
        raise SmeltError(f"mtp.fuse_layers: block {max(layers)} is not a block of the main model (0..{n_layers - 1})")


class MTPModule(nn.Module):
    def __init__(self, cfg: LlamaConfig, n_fused: int = 0):
        super().__init__()
        self.hnorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.enorm = RMSNorm(cfg.dim, cfg.norm_eps)
        if n_fused:  # absent otherwise: an unfused file keeps exactly its names
            self.fnorms = nn.ModuleList(RMSNorm(cfg.dim, cfg.norm_eps) for _ in range(n_fused))
        self.proj = nn.Linear((2 + n_fused) * cfg.dim, cfg.dim, bias=False)
        self.block = TransformerBlock(cfg)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.n_fused = n_fused

    def forward(self, h_prev: torch.Tensor, emb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | None = None) -> torch.Tensor:
        """h_prev [B, L, (1 + n_fused) d], emb [B, L, d] at the same positions -> this level's hidden states."""
        if h_prev.shape[-1] != self.proj.in_features - emb.shape[-1]:  # a level 0 without its fused layers
            raise SmeltError(f"MTP module: input of width {h_prev.shape[-1]}, expected "
                             f"{self.proj.in_features - emb.shape[-1]} (MTPHeads.level0 builds it)")
        h, *fused = h_prev.chunk(1 + self.n_fused, dim=-1)
        x = [self.hnorm(h), self.enorm(emb), *(n(r) for n, r in zip(getattr(self, "fnorms", ()), fused))]
        return self.block(self.proj(torch.cat(x, dim=-1)), cos, sin, cache)


class MTPHeads(nn.Module):
    """`depth` sequential MTP modules; they borrow the main model's embedding and output head."""

    def __init__(self, cfg: LlamaConfig, depth: int = 1, fuse_layers: tuple[int, ...] = ()):
        super().__init__()
        if depth < 1:
            raise SmeltError(f"mtp depth={depth} must be >= 1")
        _check_fuse_layers(tuple(fuse_layers), cfg.n_layers)
        self.cfg = cfg
        self.fuse_layers = tuple(fuse_layers)
        self.mtp = nn.ModuleList(MTPModule(cfg, len(fuse_layers) if k == 0 else 0) for k in range(depth))

    @property
    def depth(self) -> int:
        return len(self.mtp)

    def init_weights(self, seed: int | None = 0, std: float = 0.02, trunk: Transformer | None = None) -> None:
        """Random (norms 1, matrices N(0, std)); with `trunk`, each block starts as a copy of the trunk's
        last block (a trained block of the same shape: a far better start than noise on a small budget)."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        with torch.no_grad():
            d = self.cfg.dim
            for name, p in self.named_parameters():  # the full tensor on every rank (same seed), each keeps its shard
                if name.endswith(".bias"):  # Qwen2's q/k/v biases
                    t = torch.zeros(p.shape)
                elif p.dim() == 1:
                    t = torch.ones(p.shape)
                elif name.endswith("proj.weight"):  # fused inputs' columns: zeros after the plain module's draw
                    t = torch.cat([torch.randn(d, 2 * d, generator=gen) * std, torch.zeros(d, p.shape[1] - 2 * d)], 1)
                else:
                    t = torch.randn(p.shape, generator=gen) * std
                p.copy_(like(t.to(p.dtype), p))
            if trunk is not None:
                last = list(trunk.layers.values())[-1].state_dict()
                for m in self.mtp:
                    for k, v in m.block.state_dict().items():
                        v.copy_(last[k])

    def level0(self, trunk: Transformer, tokens: torch.Tensor, cache: dict[str, KVCache] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The main model's final hidden state h^0 [B, L, d] (its head reads it) and what module 1 reads at
        level 0: h^0, or with fused layers [h^0; r_a; ...] [B, L, (1 + n) d]."""
        h0, taps = trunk.hidden_states_and_taps(tokens, cache, self.fuse_layers)
        return h0, torch.cat([h0, *taps], dim=-1) if taps else h0

    def forward(self, trunk: Transformer, h0: torch.Tensor, tokens: torch.Tensor, features: bool = False
                ) -> list[torch.Tensor] | tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Teacher-forced logits of every module: h0 [B, T, d or (1 + n) d] (level0's second value),
        tokens [B, T].

        Returns [logits_k for k = 1..depth], logits_k [B, T - k, V]: row i predicts t_{i+k+1} (the last
        row of each predicts past the window; losses drop it). With `features`, also [f_k, B, T - k, d]:
        what the head reads from module k (its final norm's output)."""
        T = tokens.shape[1]
        if T <= self.depth:
            raise SmeltError(f"mtp depth {self.depth} needs windows longer than {self.depth} tokens, got {T}")
        h, out, feats = h0, [], []
        for k, module in enumerate(self.mtp, start=1):
            n = T - k
            h = module(h[:, :n], trunk.tok_embeddings(tokens[:, k:k + n]), trunk.rope_cos[:n], trunk.rope_sin[:n])
            f = module.norm(h)
            out.append(trunk.output(f))
            feats.append(f)
        return (out, feats) if features else out

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


def main_fingerprint(model_dir: str | Path) -> str:
    """The main model an MTP file was trained against: sha256 over config.json and the weight files
    (not masks, qparams or the MTP file itself)."""
    from models.hf_io import safetensors_files  # hf_io imports this module's neighbours; keep it lazy

    model_dir = Path(model_dir)
    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    for f in safetensors_files(model_dir):
        h.update(sha256_file(f).encode())
    return h.hexdigest()


def save_mtp(state: dict[str, torch.Tensor], cfg: LlamaConfig, out_dir: str | Path, trained_against: str,
             extra: dict[str, str] | None = None, fuse_layers: tuple[int, ...] = ()) -> None:
    """Write MTP weights ({"mtp.<k>.<param>": tensor}, gathered) as mtp.safetensors with what they belong to."""
    depth = len({k.split(".")[1] for k in state})
    meta = {"format": MTP_FORMAT, "depth": str(depth), "main_fingerprint": trained_against,
            "fuse_layers": ",".join(map(str, fuse_layers)),
            **{k: str(getattr(cfg, k)) for k in ("dim", "n_heads", "n_kv_heads", "head_dim", "ffn_hidden",
                                                 "vocab_size")}, **(extra or {})}
    atomic_save_safetensors({k: v.contiguous() for k, v in state.items()}, Path(out_dir) / MTP_FILE, metadata=meta)


def fused_layers_of(meta: dict[str, str], path: str | Path) -> tuple[int, ...]:
    """The main-model blocks an MTP file's first module reads (metadata `fuse_layers`; absent: none)."""
    text = meta.get("fuse_layers", "")
    try:
        return tuple(int(x) for x in text.split(",")) if text else ()
    except ValueError:
        raise SmeltError(f"{path}: metadata fuse_layers={text!r} is not a comma-separated list of block indices") \
            from None


def mtp_metadata(art_dir: str | Path) -> dict[str, str] | None:
    """The MTP file's metadata (None when the artifact has no MTP file); refuses another format."""
    path = Path(art_dir) / MTP_FILE
    if not path.is_file():
        return None
    meta = safetensors_metadata(path)
    if meta.get("format") != MTP_FORMAT:
        raise SmeltError(f"{path}: format {meta.get('format')!r} is not {MTP_FORMAT} (not a smelt MTP file?)")
    return meta


@torch.no_grad()
def load_mtp_into(heads: MTPHeads, art_dir: str | Path) -> None:
    """Fill MTPHeads (plain or FSDP2-sharded; each rank reads its slices) from an artifact's MTP file,
    refusing a file built for another shape or holding fewer modules than `heads` (one line, every rank)."""
    path = Path(art_dir) / MTP_FILE
    error = None
    try:
        meta = mtp_metadata(art_dir)
        if meta is None:
            raise SmeltError(f"{art_dir} has no {MTP_FILE}")
        trained = int(meta["depth"])
        if heads.depth > trained:
            raise SmeltError(f"{path}: MTP depth {heads.depth} requested, the file holds {trained} module(s)")
        fused = fused_layers_of(meta, path)
        if fused != heads.fuse_layers:
            raise SmeltError(f"{path}: its first module reads main-model blocks {list(fused)} (fuse_layers), the "
                             f"modules being loaded read {list(heads.fuse_layers)} (set mtp.fuse_layers to match)")
        for k in ("dim", "n_heads", "n_kv_heads", "head_dim", "ffn_hidden", "vocab_size"):
            if meta.get(k) != str(getattr(heads.cfg, k)):
                raise SmeltError(f"{path}: built for {k}={meta.get(k)}, the main model has {getattr(heads.cfg, k)}")
        with open_safetensors(path) as f:
            names = set(f.keys())
            for name, p in heads.named_parameters():
                if name not in names:
                    raise SmeltError(f"{path}: no tensor {name}")
                sl = f.get_slice(name)
                if tuple(sl.get_shape()) != tuple(p.shape):
                    raise SmeltError(f"{path}: {name} has shape {tuple(sl.get_shape())}, expected {tuple(p.shape)}")
                dst = local(p)
                if dst.numel():
                    t = sl[local_slices(p)]
                    check_finite(name, t, path)
                    dst.copy_(t.to(dst.dtype))
    except Exception as e:  # noqa: BLE001 - agreed by every rank, else the others hang
        error = one_line(e) if isinstance(e, SmeltError) else f"{path}: {type(e).__name__}: {one_line(e)}"
    error = first_error(error)
    if error:
        raise SmeltError(error)


def load_mtp(art_dir: str | Path, trunk: Transformer, depth: int | None = None,
             check_fingerprint: bool = True) -> MTPHeads:
    """MTPHeads for `trunk` from an artifact (or release) directory; by default the file must have been
    trained against exactly this directory's main model."""
    meta = mtp_metadata(art_dir)
    if meta is None:
        raise SmeltError(f"{art_dir} has no {MTP_FILE}")
    depth = int(meta["depth"]) if depth is None else depth
    if depth < 1:
        raise SmeltError(f"MTP depth={depth} must be >= 1")
    if check_fingerprint and meta.get("main_fingerprint") != main_fingerprint(art_dir):
        raise SmeltError(f"{Path(art_dir) / MTP_FILE}: trained against another main model (main_fingerprint "
                         f"{meta.get('main_fingerprint', '')[:12]}, this directory's is {main_fingerprint(art_dir)[:12]})")
    path = Path(art_dir) / MTP_FILE
    try:
        heads = MTPHeads(trunk.cfg, depth, fused_layers_of(meta, path))
    except SmeltError as e:
        raise SmeltError(f"{path}: {e}") from None
    heads = heads.to(trunk.tok_embeddings.weight.device)
    load_mtp_into(heads, art_dir)
    return heads.eval()
