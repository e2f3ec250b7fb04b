"""Shared fixtures: tiny random models and a byte-level tokenizer built in-process (no hub access)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("WANDB_MODE", "disabled")

from models.llama import FLAVORS, LlamaConfig, build_model

BYTE_VOCAB = 260  # 256 bytes + <unk> <bos> <eos> <pad>


def make_byte_tokenizer():
    """A real fast tokenizer (byte-level, no merges) with BOS/EOS, small enough for tiny models."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    alphabet = ByteLevel.alphabet()
    vocab = {"<unk>": 0, "<bos>": 1, "<eos>": 2, "<pad>": 3}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>", pad_token="<pad>")


def tiny_config(name: str = "debug", **kw) -> LlamaConfig:
    base = FLAVORS[name].to_dict()
    base.update(vocab_size=BYTE_VOCAB, bos_id=1, eos_id=2)
    base.update(kw)
    return LlamaConfig.from_dict(base)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SMELT_CACHE", str(tmp_path_factory.getbasetemp() / "smelt-cache"))
    monkeypatch.setenv("WANDB_MODE", "disabled")  # a test that checks wandb turns it on (offline) itself
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def byte_tokenizer():
    return make_byte_tokenizer()


@pytest.fixture
def tiny_model_dir(tmp_path, byte_tokenizer):
    """An HF directory holding a tiny random teacher and the byte tokenizer."""
    from models.hf_io import save_hf

    model = build_model(tiny_config(max_seq_len=512), seed=1)
    out = tmp_path / "teacher"
    out.mkdir()
    save_hf(model, out, tokenizer=byte_tokenizer)
    return out
