"""Run a release (or a 2:4-pruned artifact) through the kernels: our Llama model with every quantized or 2:4
Linear replaced by a kernels.linear.KernelLinear built from the stored tensors, and no fake-quant code.

`dense_reference` builds the same model with each Linear's decompressed weight (codes * scales: the
weight QAT trained, what transformers loads), the reference `python -m kernels.check` compares against.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from core.errors import SmeltError
from core.hf_names import from_hf_name
from core.masks import load_dense_rows, load_masks
from core.patterns import NMPattern
from core.release_layout import read_release_linears
from kernels.linear import KernelLinear
from models.hf_io import config_from_hf, load_hf
from models.llama import Transformer


def _empty_model(config: dict, layers: int | None, dtype: torch.dtype) -> Transformer:
    cfg = config_from_hf(config)
    if layers is not None:
        if not 1 <= layers <= cfg.n_layers:
            raise SmeltError(f"--layers {layers} must be in [1, {cfg.n_layers}]")
        cfg.n_layers = layers
    with torch.device("meta"):
        model = Transformer(cfg).to(dtype)
    model = model.to_empty(device="cpu")
    if cfg.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    model.init_rope("cpu")
    return model


def _set_module(model: Transformer, name: str, module: torch.nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def _load_release(rel: Path, layers: int | None, dtype: torch.dtype, kernels: bool) -> Transformer:
    if not (rel / "config.json").is_file():
        raise SmeltError(f"{rel} has no config.json (not a release directory)")
    model = _empty_model(json.loads((rel / "config.json").read_text()), layers, dtype)
    linears = read_release_linears(rel)
    params = dict(model.named_parameters())
    in_model = lambda ours: ours.split(".")[0] != "layers" or ours.split(".")[1] in model.layers
    with torch.no_grad(), safe_open(str(rel / "model.safetensors"), framework="pt") as f:
        for key in f.keys():
            mod, _, param = key.rpartition(".")
            if param != "weight" or mod in linears:
                continue
            ours = from_hf_name(key)
            if in_model(ours) and ours in params:
                params[ours].copy_(f.get_tensor(key).to(dtype))
        for mod, lin in linears.items():
            ours = from_hf_name(f"{mod}.weight").removesuffix(".weight")
            if not in_model(ours):
                continue
            if kernels:
                _set_module(model, ours, KernelLinear.from_release(lin, scale_dtype=dtype))
            else:
                model.get_submodule(ours).weight.copy_(lin.weight().to(dtype))
    if model.cfg.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    return model.eval()


def kernel_model(rel: str | Path, layers: int | None = None, dtype: torch.dtype = torch.float32) -> Transformer:
    """The release's model with its quantized Linears on the kernels (first `layers` blocks if given)."""
    return _load_release(Path(rel), layers, dtype, kernels=True)


def dense_reference(rel: str | Path, layers: int | None = None, dtype: torch.dtype = torch.float32) -> Transformer:
    """The same model with decompressed dense weights (codes * scales)."""
    return _load_release(Path(rel), layers, dtype, kernels=False)


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
            _set_module(model, name, KernelLinear.from_pruned(w, keep, rows, name))
        n += 1
    if not n:
        raise SmeltError(f"{art}: no mask is 2:4, nothing runs on the 2:4 kernel")
    return model


def is_release(path: str | Path) -> bool:
    p = Path(path) / "config.json"
    return p.is_file() and "quantization_config" in json.loads(p.read_text())
