"""Sparsity masks that survive training (the format is core.masks; this is the mechanism).

A mask is a bool tensor shaped like a module's weight (True = keep). `MaskSet` holds (parameter, mask)
pairs. Fixed masks (the default): after every backward the masked gradients are zeroed (so optimizer
state never builds up on removed weights) and after every optimizer step each weight is multiplied by
its mask. It works on plain tensors and on FSDP2 DTensor shards: the mask is distributed with the
parameter's own placements, so each rank masks exactly the rows it owns (N:M groups lie inside a row,
so a row shard holds whole groups).

Masks that keep learning (`MaskLearningConfig(mode="srste")`, SR-STE, Zhou et al. 2021): a dense latent
copy of each masked weight is kept; the forward sees latent * mask, the gradient passes the mask
straight through to the latent (STE), pruned latents get an extra decay lambda * latent (the
"sparse-refined" term, so a weight that was pruned must earn its way back), and every `every` steps the
mask is re-selected as the top n of m |latent| in each group. The latents start as the artifact's own
weights, whose pruned entries are 0, so the first selection is the pruner's mask and a group changes
only when a pruned latent outgrows a kept one. After `freeze_fraction` of the steps the mask is frozen
and training goes on as with fixed masks, so the last steps tune the weights of the final mask, which
holds the pattern exactly. Rows declared dense (protected heads) stay dense throughout.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from core.dtensor import like, local
from core.errors import SmeltError
from core.patterns import NMPattern

MODES = ("fixed", "srste")


@dataclass(kw_only=True)
class MaskLearningConfig:
    """How masks behave during training; the trainer's `--mask_learning.*` section."""

    mode: str = "fixed"            # fixed: the artifact's masks; srste: re-selected by latent magnitude
    pattern: str = "2:4"           # the N:M pattern re-selection keeps (the artifact's masks must hold it)
    decay: float = 2e-4            # SR-STE's lambda_W on pruned latents (added to their gradient)
    every: int = 1                 # optimizer steps between re-selections
    freeze_fraction: float = 0.75  # the mask is frozen after this share of the steps (< 1)
    nm: NMPattern | None = field(default=None, init=False, repr=False)  # `pattern`, parsed once

    def __post_init__(self):
        if self.mode not in MODES:
            raise SmeltError(f"mask_learning.mode={self.mode!r} is not one of {', '.join(MODES)}")
        self.nm = NMPattern.parse(self.pattern, "mask_learning.pattern")
        if self.decay < 0:
            raise SmeltError(f"mask_learning.decay={self.decay} must be >= 0")
        if self.every < 1:
            raise SmeltError(f"mask_learning.every={self.every} must be >= 1")
        if not 0 < self.freeze_fraction < 1:
            raise SmeltError(f"mask_learning.freeze_fraction={self.freeze_fraction} must be in (0, 1): a "
                             f"schedule that ends unfrozen leaves no steps to train the final mask's weights")

    def freeze_step(self, steps: int) -> int:
        """The last step that re-selects the mask (steps after it keep the mask fixed)."""
        return max(1, math.floor(self.freeze_fraction * steps))


def reselect(latent: torch.Tensor, nm: NMPattern, pinned: torch.Tensor) -> torch.Tensor:
    """The keep-mask of the n largest |latent| in each group of m along the last dim, all True where
    `pinned` (rows declared dense). Pure: the maths of SR-STE's mask update."""
    return nm.keep_top(latent.abs()) | pinned


def changed_groups(before: torch.Tensor, after: torch.Tensor, m: int) -> torch.Tensor:
    """How many groups of m consecutive entries differ between two keep-masks of the same shape (a 0-d
    tensor: no device sync in the training step)."""
    return (before != after).reshape(-1, m).any(dim=-1).sum()


class MaskSet:
    def __init__(self, model: nn.Module, masks: dict[str, torch.Tensor],
                 learning: MaskLearningConfig | None = None, dense_rows: dict[str, torch.Tensor] | None = None,
                 steps: int = 0):
        """masks: {module name: bool keep-mask shaped like module.weight}; dense_rows: {module name: bool
        [out_features]} (core.masks); steps: the run's step count (the freeze schedule)."""
        self.learning = learning or MaskLearningConfig()
        self.learns = self.learning.mode != "fixed"
        self.last_select = self.learning.freeze_step(steps) if self.learns else 0
        modules = dict(model.named_modules())
        self.pairs: list[tuple[str, nn.Parameter, torch.Tensor]] = []
        self.latent: dict[str, torch.Tensor] = {}  # srste: dense latent weights
        self.pinned: dict[str, torch.Tensor] = {}  # srste: [out, 1], True on rows declared dense
        self.flipped: torch.Tensor | None = None   # srste: groups the last re-selection changed (this rank)
        for name, mask in masks.items():
            mod = modules.get(name)
            if mod is None or not hasattr(mod, "weight"):
                raise SmeltError(f"mask for {name!r} has no matching module with a weight in the model")
            w = mod.weight
            if tuple(mask.shape) != tuple(w.shape):
                raise SmeltError(f"mask for {name} has shape {tuple(mask.shape)}, weight is {tuple(w.shape)}")
            self.pairs.append((name, w, like(mask.bool().clone(), w)))  # updated in place when learning
            if self.learns:
                rows = (dense_rows or {}).get(name)
                if not self.learning.nm.holds(mask, rows):
                    raise SmeltError(f"mask_learning.pattern {self.learning.nm}: the mask of {name} does not "
                                     f"hold it (re-selection keeps the artifact's pattern)")
                pinned = torch.zeros(mask.shape[0], 1, dtype=torch.bool)
                if rows is not None:
                    pinned[rows] = True
                self.pinned[name] = like(pinned, w)  # row-sharded like the weight, broadcast over inputs
                self.latent[name] = w.detach().clone()  # the loaded weights (a resume overwrites them)

    def __len__(self) -> int:
        return len(self.pairs)

    def selecting(self, step: int) -> bool:
        """True while step `step` trains the latents and may re-select the mask."""
        return self.learns and step <= self.last_select

    @torch.no_grad()
    def apply_to_weights(self) -> None:
        for _, w, m in self.pairs:
            local(w).mul_(local(m).to(local(w).dtype))

    @torch.no_grad()
    def apply_to_grads(self, step: int = 0) -> None:
        if self.selecting(step):
            return  # straight-through: the latent gets the gradient of its masked forward weight
        for _, w, m in self.pairs:
            if w.grad is not None:
                local(w.grad).mul_(local(m).to(local(w.grad).dtype))

    @torch.no_grad()
    def before_step(self, step: int) -> None:
        """srste, before the optimizer step: the decay on pruned latents, then the parameters hold the
        latents so the optimizer updates them."""
        if not self.selecting(step):
            return
        lam = self.learning.decay
        for name, w, m in self.pairs:
            lat, mk = local(self.latent[name]), local(m)
            if w.grad is not None and lam:
                g = local(w.grad)
                g.add_(lat.to(g.dtype) * (~mk).to(g.dtype), alpha=lam)
            local(w).copy_(lat)

    @torch.no_grad()
    def after_step(self, step: int) -> None:
        """After the optimizer step: srste keeps the updated latents and re-selects; every mode then masks."""
        if self.selecting(step):
            select = step % self.learning.every == 0 or step == self.last_select
            flipped = []
            for name, w, m in self.pairs:
                lat = local(self.latent[name])
                lat.copy_(local(w))
                if select:
                    new = reselect(lat, self.learning.nm, local(self.pinned[name]))
                    flipped.append(changed_groups(local(m), new, self.learning.nm.m))
                    local(m).copy_(new)
            self.flipped = torch.stack(flipped).sum() if flipped else None
        self.apply_to_weights()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """What a resumed srste run needs (latents and current masks); {} for fixed masks (the masks then
        come from the artifact)."""
        out = {}
        for name, _, m in self.pairs:
            if name in self.latent:
                out[f"{name}.latent"] = self.latent[name]
                out[f"{name}.mask"] = m.to(torch.uint8)
        return out

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for name, _, m in self.pairs:
            if f"{name}.latent" in state:
                local(self.latent[name]).copy_(local(state[f"{name}.latent"]))
                local(m).copy_(local(state[f"{name}.mask"]).bool())

    @torch.no_grad()
    def violations(self) -> int:
        """Number of weights that are non-zero where the mask says removed (0 when intact)."""
        return int(sum((local(w)[~local(m)] != 0).sum().item() for _, w, m in self.pairs))
