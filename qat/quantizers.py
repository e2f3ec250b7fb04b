"""Integer weight quantisation maths as pure functions: specs, scales/zero points, quantise/dequantise, RTN.

Conventions (shared with qat.gptq and qat.fake_quant):
- W is [out, in] like nn.Linear.weight; inputs are never modified in place.
- Groups are `group_size` consecutive input features of one output row; scale and zero_point are
  [out, n_groups] (n_groups = 1 for per-channel). Group sizes must divide in_features (no padding).
- Maths runs in fp32 (fp64 stays fp64); scales come back in that dtype, integers as torch.int8.

The numbers match compressed-tensors 0.20 (the format our W4 release is saved in, and what vLLM loads),
so fake-quantised training sees bit-for-bit what the exported checkpoint decompresses to:
- range (quantization/utils/helpers.py `_calculate_range`): q in [-2^(b-1), 2^(b-1) - 1], i.e. int4 is
  [-8, 7] for symmetric *and* asymmetric; zero points are signed int8 in the same range (the
  pack-quantized compressor adds 2^(b-1) to store them as uint, `pack_to_int32`).
- scales (helpers.py `calculate_qparams`): the range is first widened to contain 0; then
  symmetric:  scale = absmax / ((qmax - qmin) / 2)   -- absmax / 7.5 for int4, not absmax / 7, so
              -absmax lands on -8 and +absmax on 7.5, clamped to 7 (half a step of clipping);
  asymmetric: scale = (max - min) / (qmax - qmin),  zero_point = round(clamp(qmin - min / scale));
  a zero scale (all-zero group) becomes finfo(dtype).eps.
- quantise (lifecycle/forward_helpers.py `_quantize`): q = round(clamp(x / scale + zp, qmin, qmax)),
  round-half-to-even; dequantise (`_dequantize`): (q - zp) * scale. Zero is always exact.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from core.errors import SmeltError

SUPPORTED_BITS = (4, 8)
SCALE_INITS = ("minmax", "mse")
MSE_SHRINK_STEPS = 20  # clipping candidates 1.0, ..., 0.5 of the observed range
MSE_MIN_SHRINK = 0.5


@dataclass(frozen=True)
class QuantSpec:
    """How weights are quantised. group_size -1/None means one scale per output channel."""

    bits: int = 4
    symmetric: bool = True
    group_size: int | None = 64
    scale_init: str = "minmax"

    def __post_init__(self):
        if self.bits not in SUPPORTED_BITS or isinstance(self.bits, bool):
            raise SmeltError(f"quantisation bits={self.bits} is not supported: use one of {SUPPORTED_BITS}")
        if not isinstance(self.symmetric, bool):
            raise SmeltError(f"quantisation symmetric={self.symmetric!r} must be true or false")
        gs = self.group_size
        if gs == -1:
            object.__setattr__(self, "group_size", None)  # one spelling for per-channel
        elif gs is not None and (isinstance(gs, bool) or not isinstance(gs, int) or gs <= 0):
            raise SmeltError(f"group_size={gs!r} must be a positive integer, or -1/None for per-channel")
        if self.scale_init not in SCALE_INITS:
            raise SmeltError(f"scale_init={self.scale_init!r} must be one of {SCALE_INITS}")

    @property
    def qmin(self) -> int:
        return -(1 << (self.bits - 1))

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1

    def group_width(self, in_features: int) -> int:
        return in_features if self.group_size is None else self.group_size

    def n_groups(self, in_features: int) -> int:
        return in_features // self.group_width(in_features)

    def ct_args(self) -> dict:
        """The equivalent compressed-tensors QuantizationArgs fields (weights, static, minmax observer)."""
        grouped = self.group_size is not None
        return {"num_bits": self.bits, "type": "int", "symmetric": self.symmetric,
                "strategy": "group" if grouped else "channel", "group_size": self.group_size}


def check_group(in_features: int, group_size: int | None, name: str = "weight") -> None:
    """Groups must tile the input dimension exactly: padding would change what the exporter writes."""
    if group_size is None or group_size == -1:
        return
    if group_size <= 0 or in_features % group_size:
        raise SmeltError(f"group_size={group_size} does not divide in_features={in_features} of {name}")


def work_dtype(W: torch.Tensor) -> torch.dtype:
    return torch.promote_types(W.dtype, torch.float32)


def check_weight(W: torch.Tensor, spec: QuantSpec, name: str) -> None:
    if W.ndim != 2 or not W.is_floating_point():
        raise SmeltError(f"{name}: weight must be a 2-D float tensor [out, in], got {tuple(W.shape)} {W.dtype}")
    check_group(W.shape[1], spec.group_size, name)


def _grouped(W: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """[out, in] -> [out, n_groups, group_width] view."""
    return W.reshape(W.shape[0], spec.n_groups(W.shape[1]), spec.group_width(W.shape[1]))


def _check_qparams(W: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None, spec: QuantSpec) -> None:
    want = (W.shape[0], spec.n_groups(W.shape[1]))
    if tuple(scale.shape) != want:
        raise SmeltError(f"scale shape {tuple(scale.shape)} must be [out, n_groups] = {list(want)}")
    if spec.symmetric != (zp is None):
        raise SmeltError("zero_point must be None for symmetric quantisation and given for asymmetric")
    if zp is not None and tuple(zp.shape) != want:
        raise SmeltError(f"zero_point shape {tuple(zp.shape)} must be [out, n_groups] = {list(want)}")


def qparams_from_range(lo: torch.Tensor, hi: torch.Tensor, spec: QuantSpec):
    """compressed-tensors `calculate_qparams` for int: (scale, zero_point int8 or None) from min/max."""
    lo = torch.minimum(lo, torch.zeros_like(lo))  # 0 must be representable
    hi = torch.maximum(hi, torch.zeros_like(hi))
    eps = torch.finfo(lo.dtype).eps
    if spec.symmetric:
        scale = torch.maximum(lo.abs(), hi.abs()) / ((spec.qmax - spec.qmin) / 2)
        return torch.where(scale == 0, torch.full_like(scale, eps), scale), None
    scale = (hi - lo) / (spec.qmax - spec.qmin)
    scale = torch.where(scale == 0, torch.full_like(scale, eps), scale)  # lo = hi = 0: any zp works
    zp = torch.round((spec.qmin - lo / scale).clamp(spec.qmin, spec.qmax)).to(torch.int8)
    return scale, zp


def _group_sq_error(Wg: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None, spec: QuantSpec):
    """Squared fake-quantisation error per group, [out, n_groups]."""
    s = scale[..., None]
    z = 0 if zp is None else zp[..., None].to(Wg.dtype)
    deq = (torch.round((Wg / s + z).clamp(spec.qmin, spec.qmax)) - z) * s
    return (deq - Wg).pow(2).sum(-1)


def compute_qparams(W: torch.Tensor, spec: QuantSpec, name: str = "weight"):
    """(scale [out, n_groups], zero_point [out, n_groups] int8 or None) for W under `spec`.

    "minmax" uses each group's range (compressed-tensors' default observer). "mse" searches a clipping
    factor per group over 1.0 ... 0.5 of the range and keeps the one with the least squared error;
    factor 1.0 is a candidate, so it is never worse than minmax on the weights it was fitted to.
    """
    check_weight(W, spec, name)
    Wg = _grouped(W.detach().to(work_dtype(W)), spec)
    lo, hi = Wg.amin(-1), Wg.amax(-1)
    scale, zp = qparams_from_range(lo, hi, spec)
    if spec.scale_init == "mse":
        best = _group_sq_error(Wg, scale, zp, spec)
        for shrink in torch.linspace(1.0, MSE_MIN_SHRINK, MSE_SHRINK_STEPS)[1:].tolist():
            s, z = qparams_from_range(lo * shrink, hi * shrink, spec)
            err = _group_sq_error(Wg, s, z, spec)
            better = err < best  # strict: ties keep the wider (less clipped) range
            best = torch.where(better, err, best)
            scale = torch.where(better, s, scale)
            zp = None if zp is None else torch.where(better, z, zp)
    return scale, zp


def quantize(W: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None, spec: QuantSpec) -> torch.Tensor:
    """Integer codes (torch.int8, in [qmin, qmax]) of W: round(clamp(W / scale + zp))."""
    check_weight(W, spec, "weight")
    _check_qparams(W, scale, zp, spec)
    s = scale[..., None]
    Wg = _grouped(W.to(s.dtype), spec)
    if zp is not None:
        Wg = Wg / s + zp[..., None].to(s.dtype)
    else:
        Wg = Wg / s
    return torch.round(Wg.clamp(spec.qmin, spec.qmax)).to(torch.int8).reshape(W.shape)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None, spec: QuantSpec,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """(q - zp) * scale, in scale's dtype unless `dtype` is given."""
    check_group(q.shape[1], spec.group_size, "quantised weight")
    _check_qparams(q, scale, zp, spec)
    s = scale[..., None]
    qg = _grouped(q.to(s.dtype), spec)
    if zp is not None:
        qg = qg - zp[..., None].to(s.dtype)
    out = (qg * s).reshape(q.shape)
    return out if dtype is None else out.to(dtype)


def fake_quantize(W: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None, spec: QuantSpec):
    """dequantize(quantize(W)) in W's dtype: the weight the exported checkpoint decompresses to."""
    return dequantize(quantize(W, scale, zp, spec), scale, zp, spec, dtype=W.dtype)


def rtn(W: torch.Tensor, spec: QuantSpec, name: str = "weight"):
    """Round-to-nearest PTQ baseline: (fake-quantised W, scale, zero_point)."""
    W = W.detach()
    scale, zp = compute_qparams(W, spec, name)
    return fake_quantize(W, scale, zp, spec), scale, zp
