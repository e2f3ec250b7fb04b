"""Our module names (torchtitan llama3 style) <-> Hugging Face Llama names, used by every file keyed by
module name (model.safetensors, masks, qparams, releases). Pure string maps: no model import here.
"""
from __future__ import annotations

import re

from core.errors import SmeltError

_LAYER_MAP = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w2": "mlp.down_proj",
    "feed_forward.w3": "mlp.up_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_MAP = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "output": "lm_head"}
_HF_LAYER_MAP = {v: k for k, v in _LAYER_MAP.items()}
_HF_TOP_MAP = {v: k for k, v in _TOP_MAP.items()}


def to_hf_name(name: str, layer_index: dict[str, int] | None = None) -> str:
    """Our parameter/module name -> HF name. `layer_index` renumbers layers (after depth pruning)."""
    m = re.match(r"layers\.(\d+)\.(.+?)(\.weight|\.bias)?$", name)
    if m:
        i = layer_index[m.group(1)] if layer_index else int(m.group(1))
        return f"model.layers.{i}.{_LAYER_MAP[m.group(2)]}{m.group(3) or ''}"
    head, _, tail = name.partition(".")
    return _TOP_MAP[head] + ("." + tail if tail else "")


def from_hf_name(name: str) -> str:
    m = re.match(r"model\.layers\.(\d+)\.(.+?)(\.weight|\.bias)?$", name)
    if m:
        if m.group(2) not in _HF_LAYER_MAP:
            raise SmeltError(f"unexpected tensor {name} (not a Llama-family checkpoint?)")
        return f"layers.{m.group(1)}.{_HF_LAYER_MAP[m.group(2)]}{m.group(3) or ''}"
    for hf, ours in _HF_TOP_MAP.items():
        if name == hf or name.startswith(hf + "."):
            return ours + name[len(hf):]
    raise SmeltError(f"unexpected tensor {name} (not a Llama-family checkpoint?)")


def layer_index(model) -> dict[str, int]:
    """Our layer key -> HF layer number: kept layers renumbered 0..n-1 in order (after depth pruning)."""
    return {k: i for i, k in enumerate(sorted(model.layers.keys(), key=int))}
