"""One model definition: equivalence with transformers' Llama and the HF directory round trip."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_config

from core.errors import SmeltError
from models.hf_io import config_to_hf, hf_state_dict, load_hf, save_hf
from models.llama import build_model


def _hf_model(model):
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    cfg = config_to_hf(model.cfg)
    hf = LlamaForCausalLM(HFConfig(**cfg)).eval()
    missing, unexpected = hf.load_state_dict(hf_state_dict(model), strict=False)
    assert not unexpected
    assert set(missing) <= {"lm_head.weight"}  # tied
    if model.cfg.tie_embeddings:
        hf.tie_weights()
    return hf


LLAMA3_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}  # short: the scaled band falls inside head_dim 16


@pytest.mark.parametrize("flavor, scaling", [("debug", None), ("debug-untied", None), ("debug", LLAMA3_ROPE)],
                         ids=["debug", "debug-untied", "llama3-rope"])
def test_logits_match_transformers_llama(flavor, scaling):
    model = build_model(tiny_config(flavor, rope_scaling=scaling), seed=3).eval()
    hf = _hf_model(model)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 37))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() <= 1e-4
    # A real check: a different theta must break the equality (RoPE is really exercised).
    # (with llama3 scaling: the same model without it)
    other_cfg = tiny_config(flavor, rope_theta=model.cfg.rope_theta * 7) if scaling is None else tiny_config(flavor)
    other = build_model(other_cfg, seed=3).eval()
    with torch.no_grad():
        assert (other(tokens) - theirs).abs().max().item() > 1e-3


@pytest.mark.parametrize("flavor, scaling", [("debug", None), ("debug-untied", None), ("debug", LLAMA3_ROPE)],
                         ids=["debug", "debug-untied", "llama3-rope"])
def test_hf_directory_round_trip(tmp_path, byte_tokenizer, flavor, scaling):
    from transformers import AutoModelForCausalLM

    model = build_model(tiny_config(flavor, rope_scaling=scaling), seed=5).eval()
    save_hf(model, tmp_path, tokenizer=byte_tokenizer)
    assert (tmp_path / "tokenizer.json").is_file()
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 21))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ours_again = load_hf(tmp_path).eval()
    with torch.no_grad():
        ref = model(tokens)
        assert (hf(tokens).logits - ref).abs().max().item() <= 1e-4
        assert torch.equal(ours_again(tokens), ref)
    assert ours_again.cfg == model.cfg


def test_depth_pruned_model_exports_contiguous_layers(tmp_path):
    model = build_model(tiny_config("debug-untied"), seed=2).eval()
    del model.layers["1"]  # depth removal keeps the original keys: 0, 2
    save_hf(model, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2
    back = load_hf(tmp_path).eval()
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 9))
    with torch.no_grad():
        assert torch.equal(back(tokens), model(tokens))


def test_shape_mismatch_names_the_tensor(tmp_path):
    model = build_model(tiny_config(), seed=0)
    save_hf(model, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SmeltError, match=r"mlp\.(gate|down|up)_proj.*shape"):
        load_hf(tmp_path)


def test_missing_and_pickle_only_checkpoints_are_refused(tmp_path):
    with pytest.raises(SmeltError, match="does not exist"):
        load_hf(tmp_path / "nope")
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(tiny_config())))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(SmeltError, match="safetensors only"):
        load_hf(tmp_path)


def test_non_llama_config_is_refused(tmp_path):
    cfg = config_to_hf(tiny_config())
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SmeltError, match="not a Llama-family"):
        load_hf(tmp_path)


def test_unknown_model_config_key():
    with pytest.raises(ValueError, match="unknown model config key.*n_experts"):
        tiny_config(n_experts=4)
