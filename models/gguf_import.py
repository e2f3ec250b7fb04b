"""Import a llama.cpp GGUF (Llama architecture) into our model, dequantizing every tensor to fp32.

llama.cpp's converter permutes the rows of Q and K so its RoPE can rotate adjacent pairs; our model
(like HF) rotates the two halves of each head, so those rows are permuted back here.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from core.errors import SmeltError
from models.llama import LlamaConfig, Transformer

_GGUF_LAYER = {
    "attn_q": "attention.wq", "attn_k": "attention.wk", "attn_v": "attention.wv",
    "attn_output": "attention.wo", "ffn_gate": "feed_forward.w1", "ffn_down": "feed_forward.w2",
    "ffn_up": "feed_forward.w3", "attn_norm": "attention_norm", "ffn_norm": "ffn_norm",
}
_GGUF_TOP = {"token_embd": "tok_embeddings", "output_norm": "norm", "output": "output"}


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's convert `permute`: per head, interleaved (pairs) -> rotate-half order."""
    out_dim = w.shape[0]
    head_dim = out_dim // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        if default is None:
            raise SmeltError(f"GGUF is missing metadata key {key}")
        return default
    v = f.contents()
    return v


def gguf_config(reader) -> LlamaConfig:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise SmeltError(f"GGUF general.architecture={arch!r}: only Llama-architecture GGUFs are supported")
    names = {t.name for t in reader.tensors}
    n_heads = int(_field(reader, "llama.attention.head_count"))
    dim = int(_field(reader, "llama.embedding_length"))
    return LlamaConfig(
        dim=dim,
        n_layers=int(_field(reader, "llama.block_count")),
        n_heads=n_heads,
        n_kv_heads=int(_field(reader, "llama.attention.head_count_kv", n_heads)),
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"].data),
        ffn_hidden=int(_field(reader, "llama.feed_forward_length")),
        head_dim=int(_field(reader, "llama.rope.dimension_count", dim // n_heads)),
        norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        # The teacher is evaluated/trained on windows far shorter than its 8k context; the RoPE table
        # length is only a buffer size, raised if needed by callers.
        max_seq_len=min(int(_field(reader, "llama.context_length", 2048)), 8192),
        tie_embeddings="output.weight" not in names,
        bos_id=int(_field(reader, "tokenizer.ggml.bos_token_id", -1)),
        eos_id=int(_field(reader, "tokenizer.ggml.eos_token_id", -1)),
    )


def _dequantize(t) -> torch.Tensor:
    shape = tuple(int(s) for s in reversed(t.shape))  # GGUF lists dims fastest-first
    if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        arr = np.asarray(t.data, dtype=np.float32)
    else:
        arr = dequantize(t.data, t.tensor_type)
    return torch.from_numpy(np.array(arr, dtype=np.float32, copy=True).reshape(shape))


def import_gguf(path: str | Path) -> Transformer:
    """Read a Llama GGUF into an fp32 Transformer (weights exactly the dequantized GGUF values)."""
    path = Path(path)
    if not path.is_file():
        raise SmeltError(f"GGUF file {path} does not exist")
    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # gguf raises bare ValueErrors/struct errors on corrupt files
        raise SmeltError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from None
    cfg = gguf_config(reader)
    with torch.device("meta"):
        model = Transformer(cfg)
    expected = model.state_dict()
    sd: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        parts = t.name.split(".")
        if parts[0] == "blk":
            if parts[2] not in _GGUF_LAYER:
                raise SmeltError(f"GGUF tensor {t.name} is not part of a Llama block")
            name = f"layers.{parts[1]}.{_GGUF_LAYER[parts[2]]}.{parts[-1]}"
        elif parts[0] in _GGUF_TOP:
            name = f"{_GGUF_TOP[parts[0]]}.{parts[-1]}"
        elif parts[0] == "rope_freqs":
            raise SmeltError("GGUF carries rope_freqs (scaled RoPE), which models.llama does not support")
        else:
            raise SmeltError(f"unexpected GGUF tensor {t.name}")
        w = _dequantize(t)
        if parts[0] == "blk" and parts[2] == "attn_q":
            w = unpermute_rope_rows(w, cfg.n_heads)
        elif parts[0] == "blk" and parts[2] == "attn_k":
            w = unpermute_rope_rows(w, cfg.n_kv_heads)
        if name not in expected or tuple(expected[name].shape) != tuple(w.shape):
            raise SmeltError(f"GGUF tensor {t.name} has shape {tuple(w.shape)}, which the metadata "
                             f"does not imply")
        sd[name] = w
    if cfg.tie_embeddings:
        expected.pop("output.weight")
    missing = sorted(set(expected) - set(sd))
    if missing:
        raise SmeltError(f"GGUF is missing tensor for {missing[0]}")
    model = model.to_empty(device="cpu")
    model.load_state_dict(sd, strict=False, assign=True)
    if cfg.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    model.init_rope("cpu")
    return model


def gguf_tokenizer(path: str | Path):
    """The GGUF's own tokenizer, rebuilt by transformers (BPE vocab, merges, special tokens)."""
    from transformers import AutoTokenizer  # slow to import (seconds); only tokenizer loading needs it

    path = Path(path)
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
