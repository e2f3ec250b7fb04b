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
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from models.errors import SmeltError
from qat.quantizers import QuantSpec

QPARAMS_FILE = "qparams.safetensors"


def spec_to_dict(spec: QuantSpec) -> dict:
    return {"bits": spec.bits, "symmetric": spec.symmetric, "group_size": spec.group_size,
            "scale_init": spec.scale_init}


def save_qparams(model: nn.Module, qparams: dict[str, tuple[torch.Tensor, torch.Tensor | None]],
                 spec: QuantSpec, out_dir: str | Path) -> None:
    """qparams: {our module name: (scale, zero_point or None)}; names saved as HF names."""
    from models.hf_io import layer_index, to_hf_name

    index = layer_index(model)
    tensors = {}
    for name, (scale, zp) in qparams.items():
        hf = to_hf_name(name, index)
        tensors[f"{hf}.weight_scale"] = scale.float().contiguous().cpu()
        if zp is not None:
            tensors[f"{hf}.weight_zero_point"] = zp.to(torch.int8).contiguous().cpu()
    save_file(tensors, str(Path(out_dir) / QPARAMS_FILE),
              metadata={"format": "smelt-qparams/1", "spec": json.dumps(spec_to_dict(spec))})


def read_qparams(art_dir: str | Path) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor | None]], QuantSpec]:
    """({our module name: (scale, zp)}, spec) of an artifact; SmeltError if it has none."""
    from models.hf_io import from_hf_name

    path = Path(art_dir) / QPARAMS_FILE
    if not path.is_file():
        raise SmeltError(f"{art_dir} has no {QPARAMS_FILE} (not a quantized artifact)")
    with safe_open(str(path), framework="pt") as f:
        spec = QuantSpec(**json.loads(f.metadata()["spec"]))
        scales = {k.removesuffix(".weight_scale"): f.get_tensor(k) for k in f.keys() if k.endswith("_scale")}
        zps = {k.removesuffix(".weight_zero_point"): f.get_tensor(k) for k in f.keys() if k.endswith("_point")}
    return {from_hf_name(k): (v, zps.get(k)) for k, v in scales.items()}, spec


@torch.no_grad()
def load_qparams_into(model: nn.Module, art_dir: str | Path) -> bool:
    """Copy an artifact's saved scales into the model's FakeQuantLinear modules; False if it has none."""
    from models.dtensor import copy_into
    from qat.fake_quant import fake_quant_modules

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
