"""Open any model directory a command is given: an artifact (or any Llama-family HF checkpoint) or a release.

    model = load_model(path)                        # our Transformer, fp32 on the CPU by default
    heads = load_model_mtp(path, model)             # its MTP modules (None when it has none)

An artifact is read by models.hf_io. A release (`qat.release`, docs/release-format.md) is decompressed on
load: each quantized Linear's weight is its codes x scales (core.release_layout reads either 2:4 storage;
pruned weights are code 0, so the 2:4 zeros stay exact zeros), the other tensors are cast from the
serving dtype. That is bit for bit the weight QAT trained, so a release's logits are its QAT artifact's
(up to the serving dtype's rounding of the embeddings and norms). Its `mtp.safetensors` belongs to the
artifact the release was built from: `smelt_release.json` says which, and that is what is checked.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from core.errors import SmeltError
from core.files import check_finite, open_safetensors, read_json
from core.hf_names import from_hf_name
from core.release_layout import RELEASE_MANIFEST, ReleaseLinear, read_release_linears
from models.hf_io import config_from_hf, load_hf, read_hf_config
from models.llama import Transformer
from models.mtp import MTP_FILE, MTPHeads, load_mtp, mtp_metadata

RELEASE_FORMAT = "pack-quantized"  # the compressed-tensors format qat.release writes


def is_release(path: str | Path) -> bool:
    """Whether a directory is a release: its config.json carries a quantization_config."""
    p = Path(path) / "config.json"
    if not p.is_file():
        return False
    try:
        return "quantization_config" in json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False  # the loader that reads it reports the broken file


def _check_release_config(rel: Path, config: dict) -> None:
    qc = config["quantization_config"]
    method, fmt = qc.get("quant_method"), qc.get("format")
    if method != "compressed-tensors" or fmt != RELEASE_FORMAT:
        raise SmeltError(f"{rel}/config.json: quantization_config is {method} {fmt}, smelt reads releases in "
                         f"compressed-tensors {RELEASE_FORMAT} (docs/release-format.md)")


def set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


@torch.no_grad()
def load_release(rel: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 layers: int | None = None,
                 linear: Callable[[ReleaseLinear], nn.Module] | None = None) -> Transformer:
    """Our model from a release: every quantized Linear decompressed (codes x scales, in `dtype`), or, with
    `linear`, replaced by the module it returns (the kernels' KernelLinear). `layers`: the first N blocks
    only (the final norm and head after them). Every tensor is checked: finite, of its parameter's shape,
    and every parameter filled."""
    rel = Path(rel)
    if not rel.is_dir():
        raise SmeltError(f"release directory {rel} does not exist")
    config = read_hf_config(rel)
    if "quantization_config" not in config:
        raise SmeltError(f"{rel}/config.json has no quantization_config (not a release)")
    _check_release_config(rel, config)
    cfg = config_from_hf(config)
    if layers is not None:
        if not 1 <= layers <= cfg.n_layers:
            raise SmeltError(f"--layers {layers} must be in [1, {cfg.n_layers}]")
        cfg.n_layers = layers
    with torch.device("meta"):
        model = Transformer(cfg).to(dtype)
    model = model.to_empty(device=device)
    if cfg.tie_embeddings:  # to_empty gives each module its own new parameter
        model.output.weight = model.tok_embeddings.weight
    weights = rel / "model.safetensors"
    with open_safetensors(weights) as f:  # a truncated or corrupt file: one line naming it
        keys = list(f.keys())
    linears = read_release_linears(rel)
    params = dict(model.named_parameters())  # a tied head appears once, as tok_embeddings.weight
    kept = lambda ours: ours.split(".")[0] != "layers" or int(ours.split(".")[1]) < cfg.n_layers
    filled = set()

    def fill(ours: str, key: str, t: torch.Tensor) -> None:
        if ours not in params:
            if kept(ours) and not (cfg.tie_embeddings and ours == "output.weight"):
                raise SmeltError(f"{weights}: tensor {key} has no place in the model (config.json says "
                                 f"{config['num_hidden_layers']} layers)")
            return
        if tuple(t.shape) != tuple(params[ours].shape):
            raise SmeltError(f"{weights}: {key} is {list(t.shape)}, config.json implies {list(params[ours].shape)}")
        check_finite(key, t, weights)
        params[ours].copy_(t.to(dtype))
        filled.add(ours)

    with open_safetensors(weights) as f:
        for key in keys:
            if key.rpartition(".")[0] in linears or key.endswith("rotary_emb.inv_freq"):
                continue
            fill(from_hf_name(key), key, f.get_tensor(key))
    for mod, lin in linears.items():
        ours = from_hf_name(f"{mod}.weight")
        check_finite(f"{mod}.weight_scale", lin.scale, weights)
        if linear is None or not kept(ours):
            fill(ours, f"{mod}.weight_packed", lin.weight())
        else:
            if ours not in params:
                raise SmeltError(f"{weights}: quantized {mod} has no place in the model")
            set_module(model, ours.removesuffix(".weight"), linear(lin))
            filled.add(ours)
    missing = sorted(set(params) - filled)
    if missing:
        raise SmeltError(f"{rel}: the release has no tensor for {missing[0]}"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    model.init_rope(device)
    return model.eval()


def load_model(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
               ) -> Transformer:
    """An artifact (models.hf_io) or a release (decompressed), in `dtype` on `device`."""
    if is_release(path):
        return load_release(path, dtype, device)
    return load_hf(path, dtype, str(device))


def release_main_model(rel: str | Path) -> str | None:
    """The fingerprint (models.mtp.main_fingerprint) of the artifact a release was built from, as its
    smelt_release.json records it for its MTP modules; None when it records none."""
    man = read_json(Path(rel) / RELEASE_MANIFEST, "a smelt release")
    return ((man.get("settings") or {}).get("mtp") or {}).get("released_main_model")


def load_model_mtp(path: str | Path, model: Transformer, any_main_model: bool = False) -> MTPHeads | None:
    """The MTP modules of an artifact or release, for `model` (its device and dtype); None when it has
    none. Unless `any_main_model`, they must have been trained against exactly this main model: an
    artifact's own weights, or for a release the artifact it was built from."""
    path = Path(path)
    meta = mtp_metadata(path)
    if meta is None:
        return None
    if not is_release(path):
        heads = load_mtp(path, model, check_fingerprint=not any_main_model)
    else:
        if not any_main_model:
            built_from = release_main_model(path)
            if built_from is None:
                raise SmeltError(f"{path}/{RELEASE_MANIFEST} records no settings.mtp.released_main_model: which "
                                 f"main model {MTP_FILE} belongs to is unknown (--any-main-model to use it anyway)")
            if meta.get("main_fingerprint") != built_from:
                raise SmeltError(f"{path / MTP_FILE}: trained against another main model (main_fingerprint "
                                 f"{meta.get('main_fingerprint', '')[:12]}, the release was built from "
                                 f"{built_from[:12]})")
        heads = load_mtp(path, model, check_fingerprint=False)
    w = model.tok_embeddings.weight
    return heads.to(device=w.device, dtype=w.dtype)
