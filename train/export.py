"""The student -> artifact export: the trainer's parameters (sharded or not, on any device) gathered into an
fp32 CPU model on rank 0, then written atomically as an HF artifact with its masks, QAT qparams and MTP heads.

`gather` is the collective half (every rank, the same order); `write_artifact` the file half (rank 0). Every
gathered tensor is brought to the CPU before it meets another: the export model lives on the CPU and the
student wherever training ran, so nothing here may mix the two.

Any saved step of a training stage (recover, MTP, QAT) becomes the same artifact offline, without the
launcher or a GPU, from its DCP checkpoint and the `smelt-export.json` the trainer writes beside it:

    python -m train.export --checkpoint RUN/checkpoint/step-N --out ARTIFACT [--overwrite]

Only the checkpoint's tensors are read (its pickled entries, the step counters and the data loader's
state, are not); the step and the tokens seen come from smelt-export.json.
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
from core.errors import ArgumentParser, SmeltError, run_cli
from core.files import atomic_dir, read_json
from core.masks import load_dense_rows, load_masks, save_masks
from models.hf_io import load_tokenizer, save_hf
from models.llama import LlamaConfig, Transformer
from models.mtp import MTP_FILE, MTPConfig, MTPHeads, main_fingerprint, save_mtp
from qat.fake_quant import FakeQuantConfig, fake_quant_modules, freeze_weight, swap_to_fake_quant
from qat.qparams import QPARAMS_FILE, save_qparams
from qat.quantizers import QuantSpec, dequantize
from train.masks import changed_groups

EXPORT_INFO = "smelt-export.json"  # beside each checkpoint step: SmeltTrainer.export_info()
EXPORT_INFO_FORMAT = 1


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
        scale = full(m.weight_scale.detach())  # a sharded parameter when learned
        if rank0:  # the weights the forward used: dequantize(codes), frozen on the CPU (freeze_weight)
            w, out.spec = cpu[f"{name}.weight"], m.spec
            out.frozen[name] = freeze_weight(w, scale, m.weight_zero_point, m.spec)
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
                   fuse_layers: tuple[int, ...] | None, joint_mtp: bool, overwrite: bool = True) -> None:
    """The artifact of a gathered student, atomically (an interrupted write leaves nothing at out_dir).
    `student`: the artifact training started from (its dense rows, and the MTP / qparams files it carries
    through); `fuse_layers`: the MTP heads' fused layers, None without heads; `joint_mtp`: the heads trained
    jointly with the main model (then a carried qparams file no longer describes it)."""
    with atomic_dir(out_dir, overwrite=overwrite) as tmp:
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


def write_from_info(g: Gathered, out_dir: Path, info: dict, overwrite: bool = True) -> None:
    """write_artifact with what SmeltTrainer.export_info() recorded; learned masks add to the manifest how
    many groups changed against the student's."""
    settings = dict(info["settings"])
    if info["mask_pattern_m"]:
        start, m = load_masks(info["student"]), info["mask_pattern_m"]
        settings["mask_learning"] = {**settings["mask_learning"],
                                     "changed_groups": int(sum(changed_groups(start[n], g.masks[n], m) for n in g.masks)),
                                     "groups": sum(g.masks[n].numel() // m for n in g.masks)}
    mtp = info["model"]["mtp"]
    write_artifact(g, out_dir, student=info["student"], stage=info["stage"], settings=settings,
                   tokenizer=load_tokenizer(info["tokenizer"]) if info["tokenizer"] else None,
                   fuse_layers=tuple(mtp["fuse_layers"]) if mtp["depth"] else None, joint_mtp=mtp["joint"],
                   overwrite=overwrite)


# ---- offline: a checkpoint -> the artifact ------------------------------------------------------------------

def _checkpoint_model(info: dict) -> tuple[Transformer, MTPHeads | None, dict[str, torch.Tensor]]:
    """The student as the trainer built it (train.titan.SmeltModel: `inner`, `mtp`), empty on the CPU, and the
    checkpoint keys that fill it."""
    spec = info["model"]
    fq, mtp = FakeQuantConfig(**spec["fake_quant"]), MTPConfig(**spec["mtp"])
    with torch.device("meta"):
        inner = Transformer(LlamaConfig.from_dict(spec["arch"]))
        if fq.enable:
            swap_to_fake_quant(inner, fq.spec, skip=fq.skip, learn_scale=fq.learn_scale)
        heads = MTPHeads(inner.cfg, mtp.depth, mtp.fuse_layers) if mtp.depth else None
    inner = inner.to_empty(device="cpu")
    if inner.cfg.tie_embeddings:
        inner.output.weight = inner.tok_embeddings.weight
    heads = heads.to_empty(device="cpu") if heads is not None else None
    keys = {f"inner.{k}": v for k, v in inner.state_dict().items()}
    keys.update({f"mtp.{k}": v for k, v in (heads.state_dict().items() if heads is not None else ())})
    return inner, heads, keys


def export_checkpoint(checkpoint: str | Path, out: str | Path, overwrite: bool = False) -> Path:
    """The artifact of one saved training step: what the live export writes at that step."""
    import torch.distributed.checkpoint as dcp

    ckpt, out = Path(checkpoint), Path(out)
    if not (ckpt / ".metadata").is_file():
        raise SmeltError(f"--checkpoint {ckpt}: not a DCP checkpoint step (no .metadata); pass RUN/checkpoint/step-N")
    info = read_json(ckpt / EXPORT_INFO, "a smelt training checkpoint's export record")
    if info.get("format") != EXPORT_INFO_FORMAT:
        raise SmeltError(f"{ckpt / EXPORT_INFO}: format {info.get('format')!r}, this smelt reads {EXPORT_INFO_FORMAT}")
    if out.exists() and not overwrite:
        raise SmeltError(f"--out {out} already exists (pass --overwrite to replace it)")
    inner, heads, state = _checkpoint_model(info)
    saved = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    masks = load_masks(info["student"])
    if info["mask_pattern_m"]:  # learned masks: the checkpoint's current ones
        for n in list(masks):
            key = f"train_state.mask_learning.{n}.mask"
            if key not in saved:
                raise SmeltError(f"--checkpoint {ckpt}: no {key}: a learning-mask run's checkpoint without its "
                                 f"current masks")
            masks[n] = torch.zeros(saved[key].size, dtype=torch.uint8)
            state[key] = masks[n]
    missing = sorted(set(state) - set(saved))
    if missing:
        raise SmeltError(f"--checkpoint {ckpt}: holds no {missing[0]} (and {len(missing) - 1} more): not the "
                         f"student smelt-export.json describes")
    dcp.load(state, checkpoint_id=str(ckpt))  # tensors only: nothing is unpickled
    modules = dict(inner.named_modules())
    pairs = [(n, modules[n].weight, m.bool()) for n, m in masks.items()]
    g = gather(inner, pairs, heads)
    write_from_info(g, out, info, overwrite=overwrite)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m train.export", description="A saved training step -> its artifact, "
                        "as the live export writes it (no launcher, no GPU).")
    ap.add_argument("--checkpoint", required=True, help="a step of a training run: RUN/checkpoint/step-N")
    ap.add_argument("--out", required=True, help="the artifact directory to write")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    args = ap.parse_args(argv)
    print(f"exported {args.checkpoint} to {export_checkpoint(args.checkpoint, args.out, args.overwrite)}")
    return 0


if __name__ == "__main__":
    run_cli(main)
