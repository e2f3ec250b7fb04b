"""Fixed sparsity masks that survive training (the format is core.masks; this is the mechanism).

A mask is a bool tensor shaped like a module's weight (True = keep). `MaskSet` holds (parameter, mask)
pairs and, after every optimizer step, multiplies each weight by its mask, and before it zeroes the
masked gradients (so optimizer state never builds up on removed weights). It works on plain tensors
and on FSDP2 DTensor shards: the mask is distributed with the parameter's own placements, so each
rank masks exactly the rows it owns.
"""
from __future__ import annotations

import torch
from torch import nn

from core.dtensor import like, local
from core.errors import SmeltError


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
