"""Run a release (or a 2:4-pruned artifact) through the kernels: our Llama model with every quantized or 2:4
Linear replaced by a kernels.linear.KernelLinear built from the stored tensors, and no fake-quant code.

`dense_reference` builds the same model with each Linear's decompressed weight (codes * scales: the
weight QAT trained, what transformers loads), the reference `python -m kernels.check` compares against.
"""
from __future__ import annotations

from pathlib import Path

import torch

from core.errors import SmeltError
from core.masks import load_dense_rows, load_masks
from core.patterns import NMPattern
from kernels.linear import KernelLinear
from models.hf_io import load_hf
from models.llama import Transformer
from models.load import load_release, set_module


def kernel_model(rel: str | Path, layers: int | None = None, dtype: torch.dtype = torch.float32) -> Transformer:
    """The release's model with its quantized Linears on the kernels (first `layers` blocks if given)."""
    return load_release(rel, dtype, layers=layers, linear=lambda lin: KernelLinear.from_release(lin, scale_dtype=dtype))


def dense_reference(rel: str | Path, layers: int | None = None, dtype: torch.dtype = torch.float32) -> Transformer:
    """The same model with decompressed dense weights (codes * scales): models.load's release loader."""
    return load_release(rel, dtype, layers=layers)


def pruned_model(art: str | Path, layers: int | None = None, dtype: torch.dtype = torch.float32,
                 kernels: bool = True) -> Transformer:
    """A 2:4-pruned artifact (masks.safetensors), its 2:4 Linears on the sparse kernel (kernels=False: the
    plain model, the reference); the first `layers` blocks only if given."""
    model = load_hf(art, dtype=dtype).eval()
    if layers is not None:
        if not 1 <= layers <= len(model.layers):
            raise SmeltError(f"--layers {layers} must be in [1, {len(model.layers)}]")
        for key in list(model.layers)[layers:]:
            del model.layers[key]
    masks, dense = load_masks(art), load_dense_rows(art)
    if not masks:
        raise SmeltError(f"{art} has no masks.safetensors (not a pruned artifact)")
    n = 0
    for name, keep in masks.items():
        rows = dense.get(name)
        if not NMPattern(2, 4).holds(keep, rows) or name.split(".")[1] not in model.layers:
            continue  # unstructured masks stay dense: the kernels run 2:4 only
        if kernels:
            w = model.get_submodule(name).weight.detach()
            set_module(model, name, KernelLinear.from_pruned(w, keep, rows, name))
        n += 1
    if not n:
        raise SmeltError(f"{art}: no mask is 2:4, nothing runs on the 2:4 kernel")
    return model
