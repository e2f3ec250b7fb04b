"""GGUF import: a tiny Llama GGUF written in-process (Q4_1 / Q8_0 / F32, llama.cpp Q/K row order)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tiny_config

from core.errors import SmeltError
from models.gguf_import import import_gguf, unpermute_rope_rows
from models.llama import build_model


def llamacpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's convert script does to Q/K rows (HF rotate-half -> interleaved pairs)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_NAMES = {"attention.wq": "attn_q", "attention.wk": "attn_k", "attention.wv": "attn_v",
          "attention.wo": "attn_output", "feed_forward.w1": "ffn_gate", "feed_forward.w2": "ffn_down",
          "feed_forward.w3": "ffn_up", "attention_norm": "attn_norm", "ffn_norm": "ffn_norm"}


def write_gguf(path, model, arch="llama"):
    import gguf
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize

    cfg = model.cfg
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.n_layers)
    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(cfg.dim)
    w.add_feed_forward_length(cfg.ffn_hidden)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    expected = {}
    for name, t in model.state_dict().items():
        if name == "output.weight" and cfg.tie_embeddings:
            continue
        arr = t.detach().numpy().astype(np.float32)
        if name.startswith("layers."):
            _, i, *rest = name.split(".")
            short = ".".join(rest[:-1])
            gname = f"blk.{i}.{_NAMES[short]}.weight"
            if short == "attention.wq":
                arr = llamacpp_permute(arr, cfg.n_heads)
            elif short == "attention.wk":
                arr = llamacpp_permute(arr, cfg.n_kv_heads)
        else:
            gname = {"tok_embeddings.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
                     "output.weight": "output.weight"}[name]
        qtype = Q.F32 if arr.ndim == 1 else (Q.Q8_0 if "token_embd" in gname else Q.Q4_1)
        if qtype == Q.F32:
            w.add_tensor(gname, arr)
        else:
            w.add_tensor(gname, quantize(arr, qtype), raw_dtype=qtype)
        expected[gname] = arr
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def test_unpermute_inverts_llamacpp_permute():
    w = np.random.default_rng(0).normal(size=(3 * 16, 8)).astype(np.float32)
    back = unpermute_rope_rows(torch.from_numpy(llamacpp_permute(w, 3)), 3)
    assert torch.equal(back, torch.from_numpy(w))
    assert not np.array_equal(llamacpp_permute(w, 3), w)


@pytest.mark.parametrize("flavor", ["debug", "debug-untied"])
def test_gguf_import_matches_the_source_model(tmp_path, flavor):
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize, quantize

    # dim=64 keeps every row a multiple of the 32-weight quantization block.
    model = build_model(tiny_config(flavor), seed=11).eval()
    path = tmp_path / "tiny.gguf"
    write_gguf(path, model)
    imported = import_gguf(path).eval()
    assert imported.cfg.tie_embeddings == model.cfg.tie_embeddings
    assert imported.cfg.rope_theta == model.cfg.rope_theta and imported.cfg.n_kv_heads == model.cfg.n_kv_heads
    # Weights equal the source after the same quantize->dequantize round trip, rows un-permuted.
    wq = model.layers["0"].attention.wq.weight.detach().numpy()
    ref = dequantize(quantize(llamacpp_permute(wq, model.cfg.n_heads), Q.Q4_1), Q.Q4_1)
    got = unpermute_rope_rows(torch.from_numpy(ref.copy()), model.cfg.n_heads)
    assert torch.equal(imported.layers["0"].attention.wq.weight, got)
    # And the imported model computes nearly what the source does (Q4_1 error only).
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 16))
    with torch.no_grad():
        a, b = imported(tokens), model(tokens)
    assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.95


def test_non_llama_and_corrupt_gguf_are_refused(tmp_path):
    model = build_model(tiny_config(), seed=0)
    path = tmp_path / "gpt2.gguf"
    write_gguf(path, model, arch="gpt2")
    with pytest.raises(SmeltError, match="only Llama-architecture"):
        import_gguf(path)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 20)
    with pytest.raises(SmeltError, match="not a readable GGUF"):
        import_gguf(bad)
    with pytest.raises(SmeltError, match="does not exist"):
        import_gguf(tmp_path / "missing.gguf")
