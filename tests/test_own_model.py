"""Bring your own model: tiny random Llama, Mistral and Qwen2 teachers as Hugging Face writes them (their own
config.json and tokenizer classes), imported exactly (logits equal to transformers'), written back as their own
architecture, refused in one line where the model would compute something else, and the debug recipe run end to
end on each (teacher -> heads -> prune -> reconstruct -> recover -> MTP -> quantize -> QAT -> release -> verify ->
report), the release loading in transformers as the teacher's architecture with the QAT artifact's logits."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT

from core.data import bos_id
from core.errors import SmeltError
from models.hf_io import ARCHITECTURES, config_from_hf, load_hf, load_tokenizer, read_hf_config, save_hf
from qat.qparams import read_qparams

SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 512, "rope_theta": 1e6}
MISTRAL_WINDOW = 24  # shorter than the recipe's evaluation windows (32) and calibration windows (64): it is used


def hf_teacher(arch: str, out: Path) -> Path:
    """A tiny random teacher saved by transformers itself, with a byte-level tokenizer of the architecture's own
    class: Llama's and Mistral's byte-fallback BPE with <s>; Qwen2's byte-level BPE with no BOS token and a padded
    vocabulary, as Qwen2 checkpoints have. Qwen2's q/k/v biases are random (transformers starts them at zero)."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaTokenizer, MistralConfig, Qwen2Config, \
        Qwen2Tokenizer

    if arch == "qwen2":
        vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
        vocab.update({ch: 3 + i for i, ch in enumerate(sorted(ByteLevel.alphabet()))})
        tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[])
        cfg = Qwen2Config(**SHAPE, vocab_size=264, tie_word_embeddings=True, bos_token_id=0, eos_token_id=2)
    else:
        # SentencePiece's word marker is a token of every Llama vocabulary: bytes alone would decode it as itself
        vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}, "\u2581": 259}
        tokenizer = LlamaTokenizer(vocab=vocab, merges=[])
        if arch == "mistral":  # head_dim 32 != hidden / heads (as Mistral-Nemo), untied, a sliding window
            cfg = MistralConfig(**SHAPE, vocab_size=260, head_dim=32, sliding_window=MISTRAL_WINDOW,
                                tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
        else:
            cfg = LlamaConfig(**SHAPE, vocab_size=260, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def teacher(request, tmp_path_factory) -> Path:
    return hf_teacher(request.param, tmp_path_factory.mktemp(request.param) / "teacher")


def _hf_logits(model_dir: Path, tokens: torch.Tensor) -> tuple[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return type(hf).__name__, hf(tokens).logits


TOKENS = torch.randint(3, 259, (2, 80), generator=torch.Generator().manual_seed(0))  # 80 > the Mistral window


def test_a_teacher_imports_exactly(teacher):
    """Our model's logits are transformers' (full forward and decoding through the KV cache), and what makes
    each architecture differ is in use: Qwen2's biases, Mistral's window."""
    cfg = read_hf_config(teacher)
    model = load_hf(teacher).eval()
    assert model.cfg.model_type == cfg["model_type"] and model.cfg.tie_embeddings == cfg["tie_word_embeddings"]
    name, want = _hf_logits(teacher, TOKENS)
    assert name == ARCHITECTURES[cfg["model_type"]]
    with torch.no_grad():
        got = model(TOKENS)
        cache = model.new_cache(2, 96)
        decoded = torch.cat([model(TOKENS[:, :40], cache), *(model(TOKENS[:, i:i + 1], cache) for i in range(40, 80))], 1)
    assert (got - want).abs().max().item() < 1e-5 and (decoded - want).abs().max().item() < 1e-5
    changed = None
    with torch.no_grad():
        if cfg["model_type"] == "qwen2":
            assert model.layers["0"].attention.wq.bias is not None and model.cfg.qkv_bias
            for layer in model.layers.values():
                layer.attention.wk.bias.zero_()
            changed = model(TOKENS)
        elif cfg["model_type"] == "mistral":
            assert model.cfg.sliding_window == MISTRAL_WINDOW and model.cfg.head_dim == 32
            for layer in model.layers.values():
                layer.attention.window = None
            changed = model(TOKENS)
    if changed is not None:
        assert (changed - want).abs().max().item() > 1e-3


def test_an_artifact_is_written_as_its_teachers_architecture(teacher, tmp_path):
    model = load_hf(teacher)
    save_hf(model, tmp_path, tokenizer=load_tokenizer(teacher))
    written, source = read_hf_config(tmp_path), read_hf_config(teacher)
    assert written["architectures"] == source["architectures"]
    assert config_from_hf(written) == config_from_hf(source)
    name, logits = _hf_logits(tmp_path, TOKENS)
    assert name == source["architectures"][0]
    with torch.no_grad():
        assert (logits - model(TOKENS)).abs().max().item() < 1e-5


def test_windows_start_with_the_tokenizers_bos_or_the_configs(teacher):
    """Qwen2's tokenizer declares no BOS token: windows start with config.json's bos_token_id (<|endoftext|>)."""
    tok = load_tokenizer(teacher)
    want = {"llama": "<s>", "mistral": "<s>", "qwen2": "<|endoftext|>"}[read_hf_config(teacher)["model_type"]]
    assert tok.convert_ids_to_tokens(bos_id(tok)) == want
    assert tok.decode(tok("smelt 熔", add_special_tokens=False)["input_ids"]).strip() == "smelt 熔"


REFUSED = [
    ("llama", {"attention_bias": True}, "attention_bias=true is not supported"),
    ("llama", {"mlp_bias": True}, "mlp_bias=true is not supported"),
    ("mistral", {"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16}, "use_sliding_window=true"),
    ("qwen2", {"layer_types": ["sliding_attention", "full_attention"]}, "layer_types ['full_attention', "
                                                                       "'sliding_attention'] are not supported"),
    ("qwen2", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, "rope_type='yarn'"),
    ("mistral", {"sliding_window": 0}, "sliding_window=0 is not a positive integer"),
    ("gemma", {}, "model_type='gemma' is not a Llama-family model (llama, mistral, qwen2)"),
    ("llama", {"hidden_size": None}, "config.json has no 'hidden_size'"),
]


@pytest.mark.parametrize("arch,edit,message", REFUSED, ids=[m for *_, m in REFUSED])
def test_what_the_model_would_compute_differently_is_refused_in_one_line(arch, edit, message):
    d = {**SHAPE, "vocab_size": 259, "model_type": arch, **edit}
    d = {k: v for k, v in d.items() if v is not None}
    with pytest.raises(SmeltError) as e:
        config_from_hf(d)
    assert message in str(e.value) and "\n" not in str(e.value)


# ---- the debug recipe, end to end -------------------------------------------------------------------------
# The three runs go side by side (most of a stage's time is its process starting, one core each). Qwen2 trains on
# 2 ranks, so its biases are sharded by FSDP2 as on a cluster; the others on 1, which is all their difference needs.
NPROC = {"llama": 1, "mistral": 1, "qwen2": 2}


@pytest.fixture(scope="module")
def recipe_runs(tmp_path_factory) -> dict[str, tuple[Path, int, str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMELT_") or k == "SMELT_CACHE"}
    env["OMP_NUM_THREADS"] = "1"
    procs = {}
    for arch in sorted(ARCHITECTURES):
        base = tmp_path_factory.mktemp(f"recipe-{arch}")
        teacher_dir, run, log = hf_teacher(arch, base / "teacher"), base / "run", base / "recipe.log"
        cmd = [sys.executable, "-m", "configs.recipe", str(ROOT / "configs" / "recipes" / "debug.toml"),
               "--set", f"teacher={teacher_dir}", "--set", f"run_dir={run}",
               "--set", f"parallelism.nproc={NPROC[arch]}"]
        with log.open("w") as f:
            procs[arch] = (run, log, subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT))
    out = {}
    for arch, (run, log, proc) in procs.items():
        code = proc.wait(timeout=1800)
        out[arch] = (run, code, log.read_text())
    return out


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_the_debug_recipe_runs_end_to_end(arch, recipe_runs):
    run, code, log = recipe_runs[arch]
    assert code == 0, log[-4000:]
    assert "PASSED: 0 failure(s)" in log and (run / "report.md").is_file()

    release = run / "release"
    config = read_hf_config(release)
    assert config["architectures"] == [ARCHITECTURES[arch]] and "quantization_config" in config
    assert f"transformers {ARCHITECTURES[arch]} loads" in log
    manifest = json.loads((release / "smelt_release.json").read_text())
    art = Path(manifest["settings"]["source"])
    # transformers decompresses the release to the QAT artifact's model: every tensor carried (Qwen2's biases
    # too), the ones that are not quantized rounded to the serving dtype
    model = load_hf(art).eval()
    qparams, _ = read_qparams(art)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.removesuffix(".weight") not in qparams:
                p.copy_(p.to(torch.bfloat16).float())
        ours = model(TOKENS)
    _, logits = _hf_logits(release, TOKENS)
    assert (logits - ours).abs().max().item() < 1e-4
    if arch == "qwen2":
        from safetensors import safe_open

        with safe_open(str(release / "model.safetensors"), framework="pt") as f:
            bias = f.get_tensor("model.layers.0.self_attn.q_proj.bias")
        assert bias.dtype == torch.bfloat16 and bias.abs().max() > 0.1
