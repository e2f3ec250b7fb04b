"""Fixed sparsity masks that survive training: the mechanism pruning, recovery and QAT plug into.

A mask is a bool tensor shaped like a module's weight (True = keep). `MaskSet` holds (parameter, mask)
pairs and, after every optimizer step, multiplies each weight by its mask, and before it zeroes the
masked gradients (so optimizer state never builds up on removed weights). It works on plain tensors
and on FSDP2 DTensor shards: the mask is distributed with the parameter's own placements, so each
rank masks exactly the rows it owns.
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from models.dtensor import like, local
from models.errors import SmeltError

MASKS_FILE = "masks.safetensors"


class MaskSet:
    def __init__(self, model: nn.Module, masks: dict[str, torch.Tensor]):
        """masks: {module name: bool keep-mask shaped like module.weight}."""
        modules = dict(model.named_modules())
        self.pairs: list[tuple[str, nn.Parameter, torch.Tensor]] = []
        for name, mask in masks.items():
            mod = modules.get(name)
            if mod is None or not hasattr(mod, "weight"):
                raise SmeltError(f"mask for {name!r} has no matching module with a weight in the model")
            w = mod.weight
            if tuple(mask.shape) != tuple(w.shape):
                raise SmeltError(f"mask for {name} has shape {tuple(mask.shape)}, weight is {tuple(w.shape)}")
            self.pairs.append((name, w, like(mask.bool(), w)))

    def __len__(self) -> int:
        return len(self.pairs)

    @torch.no_grad()
    def apply_to_weights(self) -> None:
        for _, w, m in self.pairs:
            local(w).mul_(local(m).to(local(w).dtype))

    @torch.no_grad()
    def apply_to_grads(self) -> None:
        for _, w, m in self.pairs:
            if w.grad is not None:
                local(w.grad).mul_(local(m).to(local(w.grad).dtype))

    @torch.no_grad()
    def violations(self) -> int:
        """Number of weights that are non-zero where the mask says removed (0 when intact)."""
        return int(sum((local(w)[~local(m)] != 0).sum().item() for _, w, m in self.pairs))


def masks_from_model(model: nn.Module, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Keep-masks read off the current zero pattern of the named linears."""
    mods = dict(model.named_modules())
    names = names if names is not None else [n for n, m in mods.items() if isinstance(m, nn.Linear)]
    return {n: (mods[n].weight.detach() != 0).cpu() for n in names}


def save_masks(model: nn.Module, masks: dict[str, torch.Tensor], out_dir: str | Path) -> None:
    """Masks under the HF module names of the saved weights (layers renumbered like save_hf)."""
    from models.hf_io import layer_index, to_hf_name

    index = layer_index(model)
    save_file({to_hf_name(k, index): v.to(torch.bool).contiguous() for k, v in masks.items()},
              str(Path(out_dir) / MASKS_FILE), metadata={"format": "smelt-masks/1", "keep": "True"})


def load_masks(art_dir: str | Path) -> dict[str, torch.Tensor]:
    """{our module name: bool keep-mask} from an artifact ({} when it has no masks file)."""
    from models.hf_io import from_hf_name

    p = Path(art_dir) / MASKS_FILE
    if not p.is_file():
        return {}
    return {from_hf_name(k): v.bool() for k, v in load_file(str(p)).items()}
