"""The student -> artifact export: the trainer's parameters (sharded or not, on any device) gathered into an
fp32 CPU model on rank 0, then written atomically as an HF artifact with its masks, QAT qparams and MTP heads.

`gather` is the collective half (every rank, the same order); `write_artifact` the file half (rank 0). Every
gathered tensor is brought to the CPU before it meets another: the export model lives on the CPU and the
student wherever training ran, so nothing here may mix the two.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from core.artifact import parent_record, write_manifest
from core.dtensor import full
from core.files import atomic_dir
from core.masks import load_dense_rows, save_masks
from models.hf_io import save_hf
from models.llama import Transformer
from models.mtp import MTP_FILE, main_fingerprint, save_mtp
from qat.fake_quant import fake_quant_modules, freeze_weight
from qat.qparams import QPARAMS_FILE, save_qparams
from qat.quantizers import QuantSpec, dequantize


@dataclass
class Gathered:
    """The whole student on rank 0's CPU: the export model (fake-quantized weights already dequantized from
    their codes), each QAT module's (codes, scale, zero point), the masks and the MTP heads' parameters."""
    model: Transformer
    frozen: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = field(default_factory=dict)
    spec: QuantSpec | None = None
    masks: dict[str, torch.Tensor] = field(default_factory=dict)
    mtp: dict[str, torch.Tensor] = field(default_factory=dict)


def empty_cpu_copy(student: Transformer) -> Transformer:
    """An empty fp32 CPU model of the student's architecture (depth-pruned students keep their layer keys)."""
    with torch.device("meta"):
        model = Transformer(student.cfg)
    model = model.to_empty(device="cpu")
    for k in set(model.layers.keys()) - set(student.layers.keys()):
        del model.layers[k]
    if model.cfg.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    return model


@torch.no_grad()
def gather(student: Transformer, mask_pairs, heads: nn.Module | None, into: Transformer | None = None
           ) -> Gathered | None:
    """Collective: every rank calls it; rank 0 gets the Gathered, the others None. One tensor at a time (each
    full() gathers one parameter), copied straight into a CPU model that only rank 0 builds (`into`, or an
    empty copy), so no other rank ever holds the whole model. `mask_pairs`: (name, weight, mask) as
    train.masks.MaskSet.pairs."""
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    out = Gathered(into if into is not None else empty_cpu_copy(student)) if rank0 else None
    cpu = dict(out.model.named_parameters()) if rank0 else {}
    for name, p in student.named_parameters():
        t = full(p.detach())
        if rank0 and name in cpu:  # QAT's learned scales are read below, per module
            cpu[name].copy_(t)
        del t
    for name, m in fake_quant_modules(student).items():
        scale = full(m.weight_scale.detach()).cpu()  # a sharded parameter when learned
        if rank0:  # the artifact holds the weights the forward used: dequantize(codes)
            w, out.spec = cpu[f"{name}.weight"], m.spec
            zp = None if m.weight_zero_point is None else m.weight_zero_point.detach().cpu()
            out.frozen[name] = freeze_weight(w, scale, zp, m.spec)
            w.copy_(dequantize(*out.frozen[name], m.spec))
    for n, _, m in mask_pairs:
        t = full(m.to(torch.uint8))
        if rank0:
            out.masks[n] = t.bool().cpu()
    for name, p in (heads.named_parameters() if heads is not None else ()):
        t = full(p.detach())
        if rank0:
            out.mtp[name] = t.float().cpu()
    return out


def write_artifact(g: Gathered, out_dir: Path, *, student: str, tokenizer, stage: str, settings: dict,
                   fuse_layers: tuple[int, ...] | None, joint_mtp: bool) -> None:
    """The artifact of a gathered student, atomically (an interrupted write leaves nothing at out_dir).
    `student`: the artifact training started from (its dense rows, and the MTP / qparams files it carries
    through); `fuse_layers`: the MTP heads' fused layers, None without heads; `joint_mtp`: the heads trained
    jointly with the main model (then a carried qparams file no longer describes it)."""
    with atomic_dir(out_dir, overwrite=True) as tmp:
        save_hf(g.model, tmp, tokenizer=tokenizer)
        if g.masks:
            save_masks(g.model, g.masks, tmp, load_dense_rows(student))
        if g.frozen:
            save_qparams(g.model, {n: (s, z) for n, (_, s, z) in g.frozen.items()}, g.spec, tmp)
        if fuse_layers is not None:  # trained against exactly the main model written above
            save_mtp(g.mtp, g.model.cfg, tmp, main_fingerprint(tmp), {"stage": stage}, fuse_layers)
            if not (g.frozen or joint_mtp) and (Path(student) / QPARAMS_FILE).is_file():
                shutil.copy2(Path(student) / QPARAMS_FILE, tmp / QPARAMS_FILE)
        elif (Path(student) / MTP_FILE).is_file():  # carried through; it names the model it was trained on
            shutil.copy2(Path(student) / MTP_FILE, tmp / MTP_FILE)
        write_manifest(tmp, stage=stage, settings=settings, parent=parent_record(student))
