"""The mask format: `masks.safetensors` in an artifact, one bool keep-mask per pruned module.

A mask is shaped like the module's weight, True = keep. Pruning writes it, recovery and QAT keep the
weights inside it (train.masks.MaskSet), PTQ never revives a removed weight, and the release packs it.

`<module>.weight_dense_rows` (bool [out_features], optional) declares rows the pruner left dense on
purpose (protected heads, core.protected): their mask row is all True and N:M checks skip them. Every
stage that rewrites masks carries the declaration through unchanged.
"""
from __future__ import annotations

from pathlib import Path

import torch

from core.errors import SmeltError
from core.hf_names import layer_index
from core.sidefiles import load_side_file, save_side_file

MASKS_FILE = "masks.safetensors"
MASKS_FORMAT = "smelt-masks/1"


DENSE_ROWS = "weight_dense_rows"


def save_masks(model, masks: dict[str, torch.Tensor], out_dir: str | Path,
               dense_rows: dict[str, torch.Tensor] | None = None) -> None:
    """Masks (and declared dense rows) under the HF module names of the saved weights (layers renumbered
    like save_hf)."""
    tensors = {(k, ""): v.to(torch.bool) for k, v in masks.items()}
    for k, rows in (dense_rows or {}).items():
        if k not in masks or not bool(masks[k][rows.to(masks[k].device)].all()):
            raise SmeltError(f"{MASKS_FILE}: {k} declares dense rows its keep-mask prunes")
        tensors[(k, DENSE_ROWS)] = rows.to(torch.bool)
    save_side_file(Path(out_dir) / MASKS_FILE, tensors, layer_index(model),
                   metadata={"format": MASKS_FORMAT, "keep": "True"})


def load_masks(art_dir: str | Path) -> dict[str, torch.Tensor]:
    """{our module name: bool keep-mask} from an artifact ({} when it has no masks file)."""
    p = Path(art_dir) / MASKS_FILE
    if not p.is_file():
        return {}
    tensors, _ = load_side_file(p)
    return {module: t.bool() for (module, suffix), t in tensors.items() if not suffix}


def load_dense_rows(art_dir: str | Path) -> dict[str, torch.Tensor]:
    """{our module name: bool [out_features]} rows declared dense ({} when none)."""
    p = Path(art_dir) / MASKS_FILE
    if not p.is_file():
        return {}
    tensors, _ = load_side_file(p)
    return {module: t.bool() for (module, suffix), t in tensors.items() if suffix == DENSE_ROWS}
