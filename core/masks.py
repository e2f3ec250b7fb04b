"""The mask format: `masks.safetensors` in an artifact, one bool keep-mask per pruned module.

A mask is shaped like the module's weight, True = keep. Pruning writes it, recovery and QAT keep the
weights inside it (train.masks.MaskSet), PTQ never revives a removed weight, and the release packs it.
"""
from __future__ import annotations

from pathlib import Path

import torch

from core.hf_names import layer_index
from core.sidefiles import load_side_file, save_side_file

MASKS_FILE = "masks.safetensors"
MASKS_FORMAT = "smelt-masks/1"


def save_masks(model, masks: dict[str, torch.Tensor], out_dir: str | Path) -> None:
    """Masks under the HF module names of the saved weights (layers renumbered like save_hf)."""
    save_side_file(Path(out_dir) / MASKS_FILE, {(k, ""): v.to(torch.bool) for k, v in masks.items()},
                   layer_index(model), metadata={"format": MASKS_FORMAT, "keep": "True"})


def load_masks(art_dir: str | Path) -> dict[str, torch.Tensor]:
    """{our module name: bool keep-mask} from an artifact ({} when it has no masks file)."""
    p = Path(art_dir) / MASKS_FILE
    if not p.is_file():
        return {}
    tensors, _ = load_side_file(p)
    return {module: t.bool() for (module, _), t in tensors.items()}
