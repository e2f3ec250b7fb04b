"""Quantisation-aware training: nn.Linear layers whose forward sees the int-quantised weight.

FakeQuantLinear keeps the latent full-precision weight at `<module>.weight` (so checkpoints, masks and
FSDP2 keep working unchanged) and its scales at `<module>.weight_scale` [out, n_groups] (zero points at
`<module>.weight_zero_point`, compressed-tensors' names). The forward uses Q(w) = dequantize(quantize(w)),
numerically identical to qat.quantizers.fake_quantize and so to what the exported checkpoint holds.

Gradients:
- fixed scales: straight-through estimator, w_hat = w + sg(Q(w) - w): dL/dw = dL/dw_hat.
- learn_scale=True (LSQ, Esser et al. 2020): w_hat = s * clamp(round_ste(w / s), qmin, qmax), round
  treated as the identity in backward and clamp passing gradient only inside the range, so s gets
  round(w/s) - w/s inside the range and qmin/qmax where clipped; that gradient is scaled by
  1/sqrt(group_width * qmax) (LSQ's step-size gradient scale, per group of weights sharing a scale).
Both are written as value + (x - x.detach()) so the forward value is bit-exact, not x + (q - x).

Sparsity masks are not this module's business: the trainer's MaskSet (train.masks) zeroes removed
weights after every step, and a zero weight quantizes to exactly 0 (zero is on every grid).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from core.dtensor import copy_into, full
from core.errors import SmeltError
from models.llama import DEFAULT_SKIP, linear_names
from qat.quantizers import QuantSpec, check_group, compute_qparams, fake_quantize, quantize


@dataclass(frozen=True)
class FakeQuantConfig:
    """What the trainer fake-quantizes (SmeltModel.Config.fake_quant); validated when constructed.

    bits / symmetric / group_size / scale_init are qat.quantizers.QuantSpec's (`spec`); learn_scale makes
    the scales LSQ parameters; skip lists the linears kept in full precision (models.llama.linear_names).
    """

    enable: bool = False
    bits: int = 4
    symmetric: bool = True
    group_size: int | None = 64
    scale_init: str = "minmax"
    learn_scale: bool = False
    skip: tuple[str, ...] = DEFAULT_SKIP

    def __post_init__(self):
        for name in ("enable", "learn_scale"):
            if not isinstance(getattr(self, name), bool):
                raise SmeltError(f"fake_quant.{name}={getattr(self, name)!r} must be true or false")
        if isinstance(self.skip, str) or not isinstance(self.skip, (list, tuple)) or \
                not all(isinstance(s, str) for s in self.skip):
            raise SmeltError(f"fake_quant.skip={self.skip!r} must be a list of module names")
        object.__setattr__(self, "skip", tuple(self.skip))
        for name in ("bits", "symmetric", "group_size", "scale_init"):  # QuantSpec's checks, field by field
            try:
                QuantSpec(**{name: getattr(self, name)})
            except SmeltError as e:
                raise SmeltError(f"fake_quant.{name}: {e}") from None
        object.__setattr__(self, "group_size", self.spec.group_size)  # -1 -> None, QuantSpec's spelling

    @property
    def spec(self) -> QuantSpec:
        return QuantSpec(bits=self.bits, symmetric=self.symmetric, group_size=self.group_size,
                         scale_init=self.scale_init)


def round_ste(x: torch.Tensor) -> torch.Tensor:
    """round(x) forward, identity backward (exactly round(x) in value)."""
    return x.detach().round() + (x - x.detach())


def grad_scale(x: torch.Tensor, factor: float) -> torch.Tensor:
    """x forward, gradient multiplied by `factor` backward."""
    return x.detach() + (x - x.detach()) * factor


class FakeQuantLinear(nn.Linear):
    """nn.Linear that computes with the fake-quantised weight (see the module docstring)."""

    def __init__(self, in_features: int, out_features: int, spec: QuantSpec, bias: bool = False,
                 learn_scale: bool = False, device=None, dtype=None):
        check_group(in_features, spec.group_size, "FakeQuantLinear")
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.spec, self.learn_scale = spec, learn_scale
        self._alloc_qparams(self.weight.device)

    def _alloc_qparams(self, device: torch.device) -> None:
        """Scales of 1 (zero points of 0) until init_scales(); fp32 whatever the weight dtype."""
        shape = (self.out_features, self.spec.n_groups(self.in_features))
        scale = torch.ones(shape, dtype=torch.float32, device=device)
        if self.learn_scale:
            self.weight_scale = nn.Parameter(scale)
        else:
            self.register_buffer("weight_scale", scale)
        zp = None if self.spec.symmetric else torch.zeros(shape, dtype=torch.int8, device=device)
        self.register_buffer("weight_zero_point", zp)

    @classmethod
    def from_linear(cls, linear: nn.Linear, spec: QuantSpec, learn_scale: bool = False,
                    name: str = "linear") -> FakeQuantLinear:
        """Wrap `linear`'s own weight/bias Parameters (same objects: optimizers, ties and FSDP see no
        change). Scales are initialised now unless the weight is on the meta device."""
        check_group(linear.in_features, spec.group_size, name)
        mod = cls(linear.in_features, linear.out_features, spec, bias=linear.bias is not None,
                  learn_scale=learn_scale, device="meta")
        mod.weight, mod.bias = linear.weight, linear.bias
        mod._alloc_qparams(linear.weight.device)
        if not linear.weight.is_meta:
            mod.init_scales()
        return mod

    @torch.no_grad()
    def init_scales(self) -> None:
        """(Re)compute scales/zero points from the current weight with spec.scale_init (minmax or mse).
        Call after a meta-device model is materialised and its weights loaded; collective under FSDP2."""
        if self.weight.is_meta:
            raise SmeltError("init_scales needs real weights: materialise the model (to_empty + load) first")
        if self.weight_scale.is_meta:  # to_empty() materialises buffers too; this covers loading by assign
            self._alloc_qparams(self.weight.device)
        scale, zp = compute_qparams(full(self.weight.detach()).float(), self.spec)
        copy_into(self.weight_scale, scale)
        if zp is not None:
            copy_into(self.weight_zero_point, zp)

    def quantized_weight(self) -> torch.Tensor:
        """The weight the forward uses, w_hat, differentiable w.r.t. weight (and weight_scale)."""
        spec = self.spec
        w = self.weight.float()
        zp = self.weight_zero_point
        if not self.learn_scale:
            q = fake_quantize(w.detach(), self.weight_scale.detach().float(), zp, spec)
            return q + (w - w.detach())  # STE
        gw = spec.group_width(self.in_features)
        s = grad_scale(self.weight_scale.float(), 1.0 / math.sqrt(gw * spec.qmax))
        s = s.clamp_min(torch.finfo(torch.float32).eps)[..., None]  # as compressed-tensors, scale > 0
        z = 0.0 if zp is None else zp[..., None].float()
        x = w.reshape(self.out_features, -1, gw) / s + z
        q = round_ste(x.clamp(spec.qmin, spec.qmax))
        return ((q - z) * s).reshape(w.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.quantized_weight().to(x.dtype), self.bias)

    def extra_repr(self) -> str:
        s = self.spec
        return (f"{super().extra_repr()}, int{s.bits} {'sym' if s.symmetric else 'asym'}, "
                f"group_size={s.group_size or 'channel'}, learn_scale={self.learn_scale}")


def fake_quant_modules(model: nn.Module) -> dict[str, FakeQuantLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, FakeQuantLinear)}


def quantized_linears(model: nn.Module, skip: tuple[str, ...] = DEFAULT_SKIP, field: str = "skip") -> list[str]:
    """The linears to quantize: all but those `skip` matches (see models.llama.linear_names).

    Embeddings always stay in full precision (W4A16 quantizes Linear layers only). A head tied to the
    embeddings must stay too: quantizing it would quantize the shared embedding table with it.
    """
    names = linear_names(model, skip, field=field)
    out = getattr(model, "output", None)
    emb = getattr(model, "tok_embeddings", None)
    if "output" in names and out is not None and emb is not None and out.weight is emb.weight:
        raise SmeltError(f"{field} must keep 'output': the head shares its weight with the embeddings")
    return names


def swap_to_fake_quant(model: nn.Module, spec: QuantSpec, skip: tuple[str, ...] = DEFAULT_SKIP,
                       learn_scale: bool = False, field: str = "fake_quant.skip") -> list[str]:
    """Replace the model's nn.Linear layers (all but `skip`) by FakeQuantLinear in place; returns their
    names. Every layer is checked before any is swapped. Works on meta-device models: call
    init_scales(model) once the weights are real."""
    names = quantized_linears(model, skip, field)
    modules = dict(model.named_modules())
    for name in names:
        if isinstance(modules[name], FakeQuantLinear):
            raise SmeltError(f"{name} is already fake-quantised")
        check_group(modules[name].in_features, spec.group_size, name)
    for name in names:
        parent, _, child = name.rpartition(".")
        setattr(modules[parent], child, FakeQuantLinear.from_linear(modules[name], spec, learn_scale, name))
    return names


def init_scales(model: nn.Module) -> list[str]:
    """init_scales() on every FakeQuantLinear of the model; returns their names."""
    mods = fake_quant_modules(model)
    for m in mods.values():
        m.init_scales()
    return list(mods)


def freeze_weight(w: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None, spec: QuantSpec
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(int8 codes, fp32 scale, zero point) of one full weight, on the CPU: what the forward used (the scale
    clamped as in quantized_weight) and what the export writes. Computed on the CPU whatever devices the
    inputs are on (the export's weight is on the CPU, the trainer's scale on its GPU)."""
    scale = scale.detach().float().cpu().clamp_min(torch.finfo(torch.float32).eps)
    zp = None if zp is None else zp.detach().to("cpu", copy=True)
    return quantize(w.detach().float().cpu(), scale, zp, spec), scale, zp


@torch.no_grad()
def freeze(model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """{module name: freeze_weight(...)} of every fake-quantized linear; dequantize() of these equals the
    weight the forward used. Collective under FSDP2 (every rank gets every module's codes)."""
    return {name: freeze_weight(full(m.weight.detach()), full(m.weight_scale.detach()), m.weight_zero_point,
                                m.spec)
            for name, m in fake_quant_modules(model).items()}
