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


def launch_log(proc, tail: int = 3000) -> str:
    """A failed launch's stderr tail plus the other ranks' (train.launch files them under the dump folder)."""
    args = [str(a) for a in proc.args]
    parts = [proc.stderr[-tail:]]
    if "--dump_folder" in args:
        for log in sorted((Path(args[args.index("--dump_folder") + 1]) / "rank-logs").glob("*/attempt_*/*/*.log")):
            parts.append(f"----- {log}\n{log.read_text(errors='replace')[-tail:]}")
    return "\n".join(parts)


def check_offline_export(checkpoint: Path, live: Path, out: Path) -> None:
    """`python -m train.export` of the checkpoint step the live export was made at writes the same artifact:
    every file byte for byte, the manifest but for its creation time."""
    import json

    from train.export import export_checkpoint

    export_checkpoint(checkpoint, out)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in live.iterdir())
    for p in live.iterdir():
        if p.name == "manifest.json":
            a, b = (json.loads(f.read_text()) for f in (p, out / p.name))
            a.pop("created"), b.pop("created")
            assert a == b
        else:
            assert p.read_bytes() == (out / p.name).read_bytes(), p.name


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


def make_distill_dirs(root: Path) -> Path:
    """root/teacher: a tiny random teacher (std 0.1 weights: peaked, so damage shows clearly in KL), and
    root/student: the teacher with half of every MLP gate and attention output pruned, masks kept. What the
    trainer and Slurm tests distill."""
    from core.masks import save_masks
    from models.hf_io import save_hf

    tok = make_byte_tokenizer()
    teacher = build_model(tiny_config(max_seq_len=512), seed=1)
    with torch.no_grad():
        for p in teacher.parameters():
            if p.dim() == 2:
                p.mul_(5.0)
    (root / "teacher").mkdir(parents=True)
    save_hf(teacher, root / "teacher", tokenizer=tok)
    student = build_model(tiny_config(max_seq_len=512), seed=1)
    student.load_state_dict(teacher.state_dict())
    masks = {}
    with torch.no_grad():
        for name, mod in student.named_modules():
            if name.endswith(("feed_forward.w1", "attention.wo")):
                masks[name] = mod.weight.abs() > mod.weight.abs().median()
                mod.weight.mul_(masks[name])
    (root / "student").mkdir()
    save_hf(student, root / "student", tokenizer=tok)
    save_masks(student, masks, root / "student")
    return root


def make_qat_artifact(root: Path, spec, protected, tokens: torch.Tensor) -> tuple[Path, torch.Tensor]:
    """A QAT-stage artifact (dequantized weights + masks + qparams + manifest) and the logits of the
    fake-quantized model it came from."""
    from core.artifact import parent_record, write_manifest
    from core.masks import save_masks
    from core.patterns import NMPattern
    from core.protected import dense_rows
    from models.hf_io import save_hf
    from models.llama import linear_names
    from models.mtp import MTPHeads, main_fingerprint, save_mtp
    from qat.fake_quant import fake_quant_modules, freeze, swap_to_fake_quant
    from qat.qparams import save_qparams, spec_to_dict
    from qat.quantizers import dequantize

    cfg = tiny_config()
    model = build_model(cfg, seed=1)
    mods = dict(model.named_modules())
    masks = {}
    dense = dense_rows(protected, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
    with torch.no_grad():
        for n in linear_names(model):
            masks[n] = NMPattern(2, 4).keep_top(mods[n].weight.abs())
            if n in dense:
                masks[n][dense[n]] = True
            mods[n].weight.mul_(masks[n])
    swap_to_fake_quant(model, spec)
    for fq in fake_quant_modules(model).values():  # the weights are already masked, as the trainer keeps them
        fq.init_scales()
    frozen = freeze(model)
    with torch.no_grad():
        ref = model(tokens)
    export = build_model(cfg, seed=1)  # same seed: same embeddings/norms; linears get the dequantized codes
    emods = dict(export.named_modules())
    with torch.no_grad():
        for n, (q, s, zp) in frozen.items():
            emods[n].weight.copy_(dequantize(q, s, zp, spec))
    (root / "teacher").mkdir()  # a source without a manifest, like a downloaded teacher
    (root / "prune").mkdir()
    write_manifest(root / "prune", "prune", {"pattern": "2:4"}, parent=parent_record(root / "teacher"))
    out = root / "qat"
    out.mkdir()
    save_hf(export, out, tokenizer=make_byte_tokenizer())
    save_masks(export, masks, out, dense)
    save_qparams(export, {n: (s, zp) for n, (_, s, zp) in frozen.items()}, spec, out)
    heads = MTPHeads(cfg, 1)  # MTP modules trained against this very model (here: initialised from it)
    heads.init_weights(seed=0, trunk=export)
    save_mtp(dict(heads.named_parameters()), cfg, out, main_fingerprint(out))
    write_manifest(out, "qat", {"quant": spec_to_dict(spec)}, {"ppl": 12.5}, parent=parent_record(root / "prune"))
    return out, ref
