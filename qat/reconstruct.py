"""Quantization-aware block reconstruction: a quantized artifact's blocks fitted, with the weights they will
ship (fake-quantized on their grid), to output the dense teacher's blocks; masks kept.

    python -m qat.reconstruct --artifact runs/smollm2/gptq-2of4 --out runs/smollm2/gptq-2of4-fit

Why: GPTQ fits each linear alone to its own output, so its rounding errors add up through the SwiGLU, the down
projection and the blocks after, which no per-linear fit sees (in the default chain GPTQ adds about +0.2 en KL
whatever model it starts from; docs/quantization.md). Here each block's MLP (`--fit mlp`) or every linear of it
(`--fit block`) is trained, block by block and on the quantized model's own stream by default (`--inputs
block`), on the loss prune.reconstruct uses (core.block_fit): the latent weights through the straight-through
estimator, the group scales as LSQ parameters (qat.fake_quant), each at its own lr — the block-wise stage of
EfficientQAT (Block-AP, Chen et al. 2024), on BRECQ's block objective (Li et al. 2021). The teacher's block
outputs are the target, so each block also corrects what the quantized blocks before it left.

`--teacher` may name any float model of the same shapes instead, e.g. the recovered 2:4 model this artifact was
quantized from (recipe key `target`). Why: the dense teacher's block outputs pull every block back towards a
layer-wise fit of the teacher, which undoes what distillation learned end to end; the recovered model's are
reachable by the 2:4 weights and carry that learning (docs/quantization.md).

Input: a quantized artifact (qat.ptq, or a QAT stage's): dequantized weights + qparams.safetensors (+ masks).
Output: the same format, with every fitted linear's weight = dequantize(codes) on its learned scales, so a qat
stage continues from it as from GPTQ's, and the release packs it the same way. Linears outside the fitted part
keep their codes and scales exactly.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from core import block_fit
from core.artifact import parent_record, write_manifest
from core.device import default_device, peak_rss_gib
from core.errors import SmeltError, run_cli
from core.files import atomic_dir
from core.masks import load_masks
from models.hf_io import load_hf, load_tokenizer, save_hf
from models.teacher import DEFAULT_TEACHER, resolve_teacher
from qat.fake_quant import FakeQuantLinear, freeze_weight
from qat.qparams import QPARAMS_FILE, read_qparams, save_qparams, spec_to_dict
from qat.quantizers import dequantize


@dataclass(kw_only=True)
class QuantReconstructConfig(block_fit.ReconstructConfig):
    """prune.reconstruct's settings, with what changes when the weights are on a 4-bit grid."""

    # lr (the latent weights', prune.reconstruct's 3e-3) and scale_lr from a sweep on blocks 0, 14 and 29 of the
    # default chain's GPTQ weights (weights 3e-5 to 3e-3, scales 1e-5 to 1e-3; results/bench/qreconstruct/lr-sweep-*):
    # held-out NMSE fell with both up to the largest, 14-33% below GPTQ's there
    scale_lr: float = 1e-3       # the learned group scales' (LSQ) lr, AdamW as the weights'
    inputs: str = "block"        # the quantized model's own stream, onto the teacher's block outputs

    def __post_init__(self):
        super().__post_init__()
        if not self.scale_lr > 0:
            raise SmeltError(f"--scale-lr={self.scale_lr} must be > 0")

    def param_groups(self, linears: dict[str, nn.Linear]) -> list[dict]:
        scales = [m.weight_scale for m in linears.values() if isinstance(m, FakeQuantLinear) and m.learn_scale]
        return super().param_groups(linears) + ([{"params": scales, "lr": self.scale_lr}] if scales else [])


def to_fake_quant(model: nn.Module, qparams: dict, spec) -> dict[str, nn.Linear]:
    """Swap every linear `qparams` names ({name: (scale, zp)}) for a FakeQuantLinear with learned scales, on those
    scales; returns {name: the original nn.Linear}, which shares its weight Parameter with the swapped module."""
    modules = dict(model.named_modules())
    if missing := sorted(n for n in qparams if not isinstance(modules.get(n), nn.Linear)):
        raise SmeltError(f"{QPARAMS_FILE} names {missing[0]}, which is not a linear of the model")
    originals = {}
    for name, (scale, zp) in qparams.items():
        lin = modules[name]
        fq = FakeQuantLinear.from_linear(lin, spec, learn_scale=True, name=name)
        if tuple(scale.shape) != tuple(fq.weight_scale.shape):
            raise SmeltError(f"{QPARAMS_FILE}: {name} scale shape {tuple(scale.shape)} != {tuple(fq.weight_scale.shape)}")
        with torch.no_grad():
            fq.weight_scale.copy_(scale.to(fq.weight_scale.device))
            if zp is not None:
                fq.weight_zero_point.copy_(zp.to(fq.weight_zero_point.device))
        parent, _, child = name.rpartition(".")
        setattr(modules[parent], child, fq)
        originals[name] = lin
    return originals


@torch.no_grad()
def from_fake_quant(model: nn.Module, originals: dict[str, nn.Linear]) -> dict[str, tuple]:
    """Put the original linears back, each weight set to what its fake-quantized forward used (dequantize of its
    codes on its scales); returns {name: (scale, zp)} for the artifact."""
    modules = dict(model.named_modules())
    qparams = {}
    for name, lin in originals.items():
        fq = modules[name]
        codes, scale, zp = freeze_weight(fq.weight, fq.weight_scale, fq.weight_zero_point, fq.spec)
        lin.weight.copy_(dequantize(codes, scale, zp, fq.spec).to(lin.weight))
        parent, _, child = name.rpartition(".")
        setattr(modules[parent], child, lin)
        qparams[name] = (scale, zp)
    return qparams


def main(argv: list[str] | None = None) -> None:
    ap = block_fit.fit_parser("python -m qat.reconstruct", __doc__.split("\n")[0],
                              "a quantized artifact (qat.ptq): HF directory + qparams", DEFAULT_TEACHER,
                              QuantReconstructConfig)
    args = ap.parse_args(argv)
    cfg, calib = block_fit.fit_settings(args, QuantReconstructConfig)
    src, out = Path(args.artifact), Path(args.out)
    block_fit.check_paths(src, out, args.overwrite)
    qparams, spec = read_qparams(src)
    masks = load_masks(src)  # none: a dense quantized model
    device = default_device()
    student = load_hf(src, device=str(device))
    teacher = load_hf(resolve_teacher(args.teacher), device=str(device)).eval()
    block_fit.check_pair(teacher, student, args.teacher, src)
    blocks = block_fit.parse_blocks(args.blocks, student, src)
    originals = to_fake_quant(student, qparams, spec)
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(src if (src / "tokenizer.json").is_file() else resolve_teacher(args.teacher))
    report = block_fit.fit_model(teacher, student, masks, calib.windows(tokenizer), calib, cfg, blocks)
    del teacher
    fitted = from_fake_quant(student, originals)
    block_fit.check_masks_kept(student, masks)
    with atomic_dir(out, overwrite=args.overwrite) as tmp:
        block_fit.copy_side_files(src, tmp, (QPARAMS_FILE,))  # masks, tokenizer, MTP modules
        save_hf(student, tmp)
        save_qparams(student, fitted, spec, tmp)
        settings, metrics = block_fit.fit_record(cfg, calib, device, blocks, args.teacher, report,
                                                 time.perf_counter() - t0, peak_rss_gib())
        write_manifest(tmp, stage="qreconstruct", settings={**settings, "spec": spec_to_dict(spec)}, metrics=metrics,
                       parent=parent_record(src))
    print(out)


if __name__ == "__main__":
    run_cli(main)
