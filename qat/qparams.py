"""Quantization parameters in an artifact: `qparams.safetensors` next to model.safetensors.

A quantized (PTQ or QAT) artifact stores the *dequantized* weights in model.safetensors, so it loads and
evaluates as a normal HF model whose logits equal the fake-quantized model, plus, per quantized module,
`<hf module>.weight_scale` (fp32 [out, groups]) and `<hf module>.weight_zero_point` (int8, asymmetric
only) here. The integer codes are recovered exactly as round(w / scale) + zp; the release step packs them.
The QuantSpec is stored in the file's metadata.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from core.dtensor import copy_into
from core.errors import SmeltError
from core.hf_names import layer_index
from core.sidefiles import StreamedSideFile, load_side_file, save_side_file
from qat.fake_quant import fake_quant_modules
from qat.quantizers import QuantSpec

QPARAMS_FILE = "qparams.safetensors"


def spec_to_dict(spec: QuantSpec) -> dict:
    return {"bits": spec.bits, "symmetric": spec.symmetric, "group_size": spec.group_size,
            "scale_init": spec.scale_init}


def _qparam_tensors(qparams: dict[str, tuple[torch.Tensor, torch.Tensor | None]]) -> dict:
    tensors = {}
    for name, (scale, zp) in qparams.items():
        tensors[(name, "weight_scale")] = scale.float()
        if zp is not None:
            tensors[(name, "weight_zero_point")] = zp.to(torch.int8)
    return tensors


def _qparams_meta(spec: QuantSpec) -> dict[str, str]:
    return {"format": "smelt-qparams/1", "spec": json.dumps(spec_to_dict(spec))}


def save_qparams(model: nn.Module, qparams: dict[str, tuple[torch.Tensor, torch.Tensor | None]],
                 spec: QuantSpec, out_dir: str | Path) -> None:
    """qparams: {our module name: (scale, zero_point or None)}; names saved as HF names."""
    save_side_file(Path(out_dir) / QPARAMS_FILE, _qparam_tensors(qparams), layer_index(model),
                   metadata=_qparams_meta(spec))


class StreamedQparams(StreamedSideFile):
    """The file save_qparams writes, written block by block (streamed calibration; layers keep their numbers).
    shapes: {our module name: weight shape}, in file order."""

    def __init__(self, out_dir: str | Path, shapes: dict[str, tuple[int, int]], spec: QuantSpec):
        layout = []
        for name, (rows, cols) in shapes.items():
            groups = 1 if spec.group_size in (None, -1) else cols // spec.group_size
            layout.append(((name, "weight_scale"), torch.float32, (rows, groups)))
            if not spec.symmetric:
                layout.append(((name, "weight_zero_point"), torch.int8, (rows, groups)))
        super().__init__(Path(out_dir) / QPARAMS_FILE, layout, _qparams_meta(spec))

    def write(self, qparams: dict[str, tuple[torch.Tensor, torch.Tensor | None]]) -> None:
        """Some modules' final (scale, zp), in any order."""
        super().write(_qparam_tensors(qparams))


def read_qparams(art_dir: str | Path) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor | None]], QuantSpec]:
    """({our module name: (scale, zp)}, spec) of an artifact; SmeltError if it has none."""
    path = Path(art_dir) / QPARAMS_FILE
    if not path.is_file():
        raise SmeltError(f"{art_dir} has no {QPARAMS_FILE} (not a quantized artifact)")
    tensors, meta = load_side_file(path)
    if "spec" not in meta:
        raise SmeltError(f"{path} has no 'spec' metadata (not written by smelt's qat stages)")
    spec = QuantSpec(**json.loads(meta["spec"]))
    scales = {m: t for (m, suffix), t in tensors.items() if suffix == "weight_scale"}
    return {m: (t, tensors.get((m, "weight_zero_point"))) for m, t in scales.items()}, spec


@torch.no_grad()
def load_qparams_into(model: nn.Module, art_dir: str | Path) -> bool:
    """Copy an artifact's saved scales into the model's FakeQuantLinear modules; False if it has none."""
    if not (Path(art_dir) / QPARAMS_FILE).is_file():
        return False
    saved, saved_spec = read_qparams(art_dir)
    modules = fake_quant_modules(model)
    extra = sorted(set(saved) - set(modules))
    if extra:
        raise SmeltError(f"{art_dir}/{QPARAMS_FILE} quantized {extra[0]}, which this run keeps in full precision "
                         f"(fake_quant.skip differs from the PTQ stage's)")
    for name, mod in modules.items():
        # Scales only mean something on the grid they were fitted for (bits, symmetry, groups).
        for field in ("bits", "symmetric", "group_size"):
            if getattr(saved_spec, field) != getattr(mod.spec, field):
                raise SmeltError(f"{art_dir}/{QPARAMS_FILE} was fitted for {field}={getattr(saved_spec, field)}, "
                                 f"this run quantizes {name} with {field}={getattr(mod.spec, field)}")
        if name not in saved:
            raise SmeltError(f"{art_dir}/{QPARAMS_FILE} has no scales for {name}")
        scale, zp = saved[name]
        if tuple(scale.shape) != tuple(mod.weight_scale.shape):
            raise SmeltError(f"{QPARAMS_FILE}: {name} scale shape {tuple(scale.shape)} != "
                             f"{tuple(mod.weight_scale.shape)} (different group size?)")
        copy_into(mod.weight_scale, scale)
        if zp is not None and mod.weight_zero_point is not None:
            copy_into(mod.weight_zero_point, zp)
    return True
