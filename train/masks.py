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

Masks learned as a distribution (`mode="maskllm"`, MaskLLM, Fang et al. 2024): each group of m has
logits over its C(m, n) candidate masks, starting with `prior` on the artifact's candidate (the pruner's
choice) and 0 on the others. A step's forward sees latent * (softmax((logits + Gumbel noise) / tau) @
candidates), a soft mask the loss differentiates: the latent gets the gradient times the soft mask, the
logits theirs through the softmax (Adam at `logit_lr`, kept here, not in the trainer's optimizer). tau
falls geometrically from `tau_start` to `tau_end` over the selecting steps. The latents' pruned entries
start at the dense teacher's weights, so every candidate is a real choice, not a choice of zeros. The hard
mask is each group's argmax candidate; at the freeze step it becomes the mask, as with srste. The noise is
seeded per (seed, step, module, rank): a resumed run draws the same masks.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from core.dtensor import like_part, local, local_slices
from core.errors import SmeltError
from core.patterns import NMPattern

MODES = ("fixed", "srste", "maskllm")


@dataclass(kw_only=True)
class MaskLearningConfig:
    """How masks behave during training; the trainer's `--mask_learning.*` section."""

    mode: str = "fixed"            # fixed: the artifact's masks; srste: re-selected by latent magnitude
    pattern: str = "2:4"           # the N:M pattern re-selection keeps (the artifact's masks must hold it)
    decay: float = 2e-4            # SR-STE's lambda_W on pruned latents (added to their gradient)
    every: int = 1                 # optimizer steps between re-selections
    freeze_fraction: float = 0.75  # the mask is frozen after this share of the steps (< 1)
    prior: float = 3.0             # maskllm: the artifact's candidate's starting logit (the others: 0)
    tau_start: float = 1.0         # maskllm: Gumbel-softmax temperature at step 1 ...
    tau_end: float = 0.1           # ... and at the freeze step (geometric in between)
    logit_lr: float = 0.1          # maskllm: Adam's step size on the candidate logits
    seed: int = 0                  # maskllm: the Gumbel noise's seed
    nm: NMPattern | None = field(default=None, init=False, repr=False)  # `pattern`, parsed once

    def __post_init__(self):
        if self.mode not in MODES:
            raise SmeltError(f"mask_learning.mode={self.mode!r} is not one of {', '.join(MODES)}")
        self.nm = NMPattern.parse(self.pattern, "mask_learning.pattern")
        if self.decay < 0:
            raise SmeltError(f"mask_learning.decay={self.decay} must be >= 0")
        if self.every < 1:
            raise SmeltError(f"mask_learning.every={self.every} must be >= 1")
        if not (self.tau_start > 0 and self.tau_end > 0):
            raise SmeltError(f"mask_learning.tau_start={self.tau_start} and tau_end={self.tau_end} must be > 0")
        if not self.prior >= 0:
            raise SmeltError(f"mask_learning.prior={self.prior} must be >= 0 (the pruner's candidate's head start)")
        if not self.logit_lr > 0:
            raise SmeltError(f"mask_learning.logit_lr={self.logit_lr} must be > 0")
        if not 0 < self.freeze_fraction < 1:
            raise SmeltError(f"mask_learning.freeze_fraction={self.freeze_fraction} must be in (0, 1): a "
                             f"schedule that ends unfrozen leaves no steps to train the final mask's weights")

    def freeze_step(self, steps: int) -> int:
        """The last step that re-selects the mask (steps after it keep the mask fixed)."""
        return max(1, math.floor(self.freeze_fraction * steps))

    def tau(self, step: int, last: int) -> float:
        """maskllm's temperature at `step` of 1..last: tau_start, falling geometrically to tau_end."""
        frac = 0.0 if last <= 1 else (min(step, last) - 1) / (last - 1)
        return self.tau_start * (self.tau_end / self.tau_start) ** frac


def candidates(nm: NMPattern) -> torch.Tensor:
    """The C(m, n) keep-masks of one group, float [C, m] (2:4: six)."""
    rows = [[float(i in keep) for i in range(nm.m)] for keep in itertools.combinations(range(nm.m), nm.n)]
    return torch.tensor(rows)


def prior_logits(mask: torch.Tensor, cands: torch.Tensor, prior: float) -> torch.Tensor:
    """Logits [out, in/m, C] from a keep-mask [out, in]: `prior` on each group's candidate (the one that
    overlaps the group's kept entries most), 0 elsewhere."""
    groups = mask.reshape(mask.shape[0], -1, cands.shape[1]).float()
    idx = (groups @ cands.T).argmax(-1, keepdim=True)
    return torch.zeros(*groups.shape[:2], cands.shape[0]).scatter_(-1, idx, prior)


def soft_mask(logits: torch.Tensor, noise: torch.Tensor, tau: float, cands: torch.Tensor) -> torch.Tensor:
    """MaskLLM's differentiable mask [out, in]: softmax((logits + noise) / tau) over the candidates, mixed.
    Each group's entries sum to n; as tau -> 0 it is the argmax candidate of logits + noise."""
    y = ((logits + noise) / tau).softmax(-1)
    return (y @ cands.to(y.dtype)).reshape(logits.shape[0], -1)


def hard_mask(logits: torch.Tensor, cands: torch.Tensor) -> torch.Tensor:
    """Each group's most likely candidate, as a bool keep-mask [out, in]."""
    return cands.to(logits.device)[logits.argmax(-1)].reshape(logits.shape[0], -1).bool()


def gumbel(shape: tuple[int, ...], seed: int, device: torch.device) -> torch.Tensor:
    """Standard Gumbel noise from a CPU generator seeded with `seed` (the same on every device)."""
    u = torch.rand(shape, generator=torch.Generator().manual_seed(seed)).clamp_(1e-10, 1 - 1e-7)
    return (-(-u.log()).log()).to(device)


def reselect(latent: torch.Tensor, nm: NMPattern, pinned: torch.Tensor) -> torch.Tensor:
    """The keep-mask of the n largest |latent| in each group of m along the last dim, all True where
    `pinned` (rows declared dense). Pure: the maths of SR-STE's mask update."""
    return nm.keep_top(latent.abs()) | pinned


def changed_groups(before: torch.Tensor, after: torch.Tensor, m: int) -> torch.Tensor:
    """How many groups of m consecutive entries differ between two keep-masks of the same shape (a 0-d
    tensor: no device sync in the training step)."""
    return (before != after).reshape(-1, m).any(dim=-1).sum()


class _InMemory:
    """Masks held in a dict, read like core.masks.MasksOnDisk (names, shape, part)."""

    def __init__(self, masks: dict[str, torch.Tensor]):
        self.masks = masks

    def names(self) -> list[str]:
        return list(self.masks)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.masks[name].shape)

    def part(self, name: str, slices: tuple[slice, ...]) -> torch.Tensor:
        return self.masks[name][slices].bool()


class MaskSet:
    def __init__(self, model: nn.Module, masks: dict[str, torch.Tensor],
                 learning: MaskLearningConfig | None = None, dense_rows: dict[str, torch.Tensor] | None = None,
                 steps: int = 0, dense_source: nn.Module | None = None):
        """masks: {module name: bool keep-mask shaped like module.weight}, or core.masks.MasksOnDisk (each rank
        reads only its rows of each mask); dense_rows: {module name: bool
        [out_features]} (core.masks); steps: the run's step count (the freeze schedule); dense_source: the
        dense model (maskllm: the teacher, sharded like the student) whose weights fill the pruned latents."""
        self.learning = learning or MaskLearningConfig()
        self.learns = self.learning.mode != "fixed"
        self.maskllm = self.learning.mode == "maskllm"
        self.last_select = self.learning.freeze_step(steps) if self.learns else 0
        modules = dict(model.named_modules())
        dense_modules = dict(dense_source.named_modules()) if dense_source is not None else {}
        self.cands = candidates(self.learning.nm) if self.maskllm else None
        self.pairs: list[tuple[str, nn.Parameter, torch.Tensor]] = []
        self.latent: dict[str, torch.Tensor] = {}  # srste, maskllm: dense latent weights
        self.pinned: dict[str, torch.Tensor] = {}  # srste, maskllm: [out, 1], True on rows declared dense
        self.logits: dict[str, torch.Tensor] = {}  # maskllm: [out, in/m, C] candidate logits
        self.moments: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # maskllm: the logits' Adam moments
        self.flipped: torch.Tensor | None = None   # groups the last re-selection changed (this rank)
        self._soft_step = 0                        # maskllm: the step whose soft masks the weights hold
        masks = masks if hasattr(masks, "part") else _InMemory(masks)
        for name in masks.names():
            mod = modules.get(name)
            if mod is None or not hasattr(mod, "weight"):
                raise SmeltError(f"mask for {name!r} has no matching module with a weight in the model")
            w = mod.weight
            if tuple(masks.shape(name)) != tuple(w.shape):
                raise SmeltError(f"mask for {name} has shape {tuple(masks.shape(name))}, weight is {tuple(w.shape)}")
            rows_at = local_slices(w)[0]  # this rank's rows: the mask is read only there (FSDP2 shards dim 0)
            mask = masks.part(name, local_slices(w))
            self.pairs.append((name, w, like_part(mask.clone(), w)))  # updated in place when learning
            if self.learns:
                rows = (dense_rows or {}).get(name)
                rows = rows[rows_at] if rows is not None else None
                if not self.learning.nm.holds(mask, rows):  # groups lie within rows: each rank checks its own
                    raise SmeltError(f"mask_learning.pattern {self.learning.nm}: the mask of {name} does not "
                                     f"hold it (re-selection keeps the artifact's pattern)")
                pinned = torch.zeros(mask.shape[0], 1, dtype=torch.bool)
                if rows is not None:
                    pinned[rows] = True
                self.pinned[name] = like_part(pinned, w)  # row-sharded like the weight, broadcast over inputs
                self.latent[name] = w.detach().clone()  # the loaded weights (a resume overwrites them)
            if self.maskllm:
                src = getattr(dense_modules.get(name), "weight", None)
                if src is None or tuple(src.shape) != tuple(w.shape):
                    raise SmeltError(f"mask_learning.mode maskllm: the teacher has no {name} of shape "
                                     f"{tuple(w.shape)} (the pruned latents start at the dense weights)")
                lat, keep = local(self.latent[name]), local(self.pairs[-1][2])
                with torch.no_grad():
                    lat.copy_(torch.where(keep, lat, local(src).to(lat.dtype)))
                start = prior_logits(mask, self.cands, self.learning.prior)  # row by row: this rank's rows
                self.logits[name] = like_part(start, w)  # sharded by rows like the weight (DCP saves each shard)
                zeros = torch.zeros_like(start)
                self.moments[name] = (like_part(zeros, w), like_part(zeros.clone(), w))

    def __len__(self) -> int:
        return len(self.pairs)

    def selecting(self, step: int) -> bool:
        """True while step `step` trains the latents and may re-select the mask. Step 0 never does: it is
        torchtitan's zero-gradient optimizer step that builds the optimizer state before a resume."""
        return self.learns and 1 <= step <= self.last_select

    def _soft(self, index: int, name: str, step: int, lg: torch.Tensor | None = None) -> torch.Tensor:
        """maskllm: module `index`'s soft mask for `step` (its own Gumbel draw) from its logits (or `lg`, a
        copy that requires grad), 1 on pinned rows."""
        lg = local(self.logits[name]) if lg is None else lg
        rank = dist.get_rank() if dist.is_initialized() else 0
        seed = ((self.learning.seed * 1_000_003 + step) * 10_007 + index) * 1_009 + rank
        m = soft_mask(lg, gumbel(tuple(lg.shape), seed, lg.device), self.learning.tau(step, self.last_select),
                      self.cands.to(lg.device))
        return torch.where(local(self.pinned[name]), torch.ones_like(m), m)

    @torch.no_grad()
    def before_forward(self, step: int) -> None:
        """maskllm, before a selecting step's first forward: the weights become latent x this step's soft mask."""
        if not (self.maskllm and self.selecting(step)) or self._soft_step == step:
            return
        for i, (name, w, _) in enumerate(self.pairs):
            lat = local(self.latent[name])
            local(w).copy_(lat * self._soft(i, name, step).to(lat.dtype))
        self._soft_step = step

    @torch.no_grad()
    def apply_to_weights(self) -> None:
        for _, w, m in self.pairs:
            local(w).mul_(local(m).to(local(w).dtype))

    @torch.no_grad()
    def apply_to_grads(self, step: int = 0) -> None:
        if self.selecting(step):
            return  # srste: straight-through; maskllm: before_step splits the gradient
        for _, w, m in self.pairs:
            if w.grad is not None:
                local(w.grad).mul_(local(m).to(local(w.grad).dtype))

    @torch.no_grad()
    def before_step(self, step: int) -> None:
        """Before the optimizer step, while selecting: srste adds the decay on pruned latents; maskllm splits
        the forward weight's gradient G into the latent's (G x soft mask) and the logits' (through the
        softmax, from G x latent) and steps the logits. Then the parameters hold the latents, so the
        optimizer updates them."""
        if not self.selecting(step):
            return
        lam = self.learning.decay
        for i, (name, w, m) in enumerate(self.pairs):
            lat, mk = local(self.latent[name]), local(m)
            if self.maskllm and w.grad is not None:
                g = local(w.grad)
                logits = local(self.logits[name])
                # this step's soft mask again (same noise), now with a graph: keeping every module's soft
                # mask and graph from before_forward would hold about 1.5 more copies of the masked weights
                probe = logits.detach().clone().requires_grad_(True)
                with torch.enable_grad():
                    soft = self._soft(i, name, step, probe)
                    soft.backward(g.float() * lat.float())  # dL/dsoft = G x latent
                self._adam(name, logits, probe.grad, step)
                g.mul_(soft.detach().to(g.dtype))
            elif w.grad is not None and lam:
                g = local(w.grad)
                g.add_(lat.to(g.dtype) * (~mk).to(g.dtype), alpha=lam)
            local(w).copy_(lat)

    def _adam(self, name: str, logits: torch.Tensor, grad: torch.Tensor, step: int,
              betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:
        """One bias-corrected Adam step on a module's logits (in place; `step` counts from 1)."""
        m, v = (local(t) for t in self.moments[name])
        m.mul_(betas[0]).add_(grad, alpha=1 - betas[0])
        v.mul_(betas[1]).addcmul_(grad, grad, value=1 - betas[1])
        denom = (v / (1 - betas[1] ** step)).sqrt_().add_(eps)
        logits.addcdiv_(m, denom, value=-self.learning.logit_lr / (1 - betas[0] ** step))

    @torch.no_grad()
    def after_step(self, step: int) -> None:
        """After the optimizer step: the learning modes keep the updated latents and re-select (srste: by
        magnitude; maskllm: each group's most likely candidate); every mode then masks."""
        if self.selecting(step):
            select = step % self.learning.every == 0 or step == self.last_select
            flipped = []
            for name, w, m in self.pairs:
                lat = local(self.latent[name])
                lat.copy_(local(w))
                if select:
                    pinned = local(self.pinned[name])
                    new = (hard_mask(local(self.logits[name]), self.cands) | pinned if self.maskllm
                           else reselect(lat, self.learning.nm, pinned))
                    flipped.append(changed_groups(local(m), new, self.learning.nm.m))
                    local(m).copy_(new)
            self.flipped = torch.stack(flipped).sum() if flipped else None
        self.apply_to_weights()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """What a resumed learning run needs (latents and current masks; maskllm: the logits and their Adam
        moments); {} for fixed masks (the masks then come from the artifact)."""
        out = {}
        for name, _, m in self.pairs:
            if name in self.latent:
                out[f"{name}.latent"] = self.latent[name]
                out[f"{name}.mask"] = m.to(torch.uint8)
            if name in self.logits:
                out[f"{name}.logits"] = self.logits[name]
                out[f"{name}.logits_m"], out[f"{name}.logits_v"] = self.moments[name]
        return out

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for name, _, m in self.pairs:
            if f"{name}.latent" in state:
                local(self.latent[name]).copy_(local(state[f"{name}.latent"]))
                local(m).copy_(local(state[f"{name}.mask"]).bool())
            if name in self.logits:
                local(self.logits[name]).copy_(local(state[f"{name}.logits"]))
                for mine, saved in zip(self.moments[name], ("logits_m", "logits_v")):
                    local(mine).copy_(local(state[f"{name}.{saved}"]))
        self._soft_step = 0  # the next selecting step draws its soft masks from the restored state

    @torch.no_grad()
    def violations(self) -> int:
        """Number of weights that are non-zero where the mask says removed (0 when intact)."""
        return int(sum((local(w)[~local(m)] != 0).sum().item() for _, w, m in self.pairs))
