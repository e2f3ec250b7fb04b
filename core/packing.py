"""Weight layouts the release stores and the kernels read: int4 codes packed in int32 words, and 2:4 kept
values with their position metadata. Pure tensor functions (no Triton, no stage): the exporter writes with
them, the verifier and the kernels' loader read with them, and every layout round-trips exactly.

int4 (compressed-tensors `pack-quantized`, 4 bits): codes q in [-8, 7] are stored as q + 8; input i of a
row sits at bits 4 * (i % 8) of int32 word i // 8.

2:4 (`smelt-24/1`, docs/release-format.md): each group of 4 consecutive inputs of a row keeps 2 slots.
- values `[out, in / 2]`: the kept entries of each group in input order (slot 0 then slot 1); a group that
  keeps fewer than 2 fills its remaining slots with zeros at positions it does not use;
- meta int32 `[out, in / 32]`: group g's 4 bits sit at bits 4 * (g % 8) of word g // 8; bits 0-1 are
  slot 0's position in the group, bits 2-3 slot 1's, with slot 0's position < slot 1's.
With int4 values the kept codes are then packed like any int4 row (`[out, in / 16]` words).
"""
from __future__ import annotations

import torch

from core.errors import SmeltError

INT4_PER_WORD = 8
GROUPS_PER_META_WORD = 8  # 4 bits per group of 4 inputs -> 32 inputs per int32 word
META_INPUTS = 4 * GROUPS_PER_META_WORD


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int codes [out, in] in [-8, 7] -> int32 [out, in / 8] (compressed-tensors' pack-quantized)."""
    if q.ndim != 2 or q.shape[1] % INT4_PER_WORD:
        raise SmeltError(f"int4 packing needs [out, in] with in a multiple of 8, got {list(q.shape)}")
    if q.numel() and (q.min() < -8 or q.max() > 7):
        raise SmeltError("int4 codes outside [-8, 7]")
    u = (q.to(torch.int64) + 8).reshape(q.shape[0], -1, INT4_PER_WORD)
    words = (u << (4 * torch.arange(INT4_PER_WORD))).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # same bits, signed


def unpack_int4(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """int32 [out, ceil(in / 8)] -> int8 codes [out, in] in [-8, 7]."""
    if packed.dtype != torch.int32 or packed.ndim != 2 or packed.shape[1] * INT4_PER_WORD < in_features:
        raise SmeltError(f"packed int4 must be int32 [out, >= {in_features} / 8], got "
                         f"{packed.dtype} {list(packed.shape)}")
    # int32 shifts (an arithmetic shift keeps the low nibble right) and in-place steps: a large Linear's codes
    # cost one int32 and one int8 copy of the weight, not several int64 ones
    nib = packed[..., None] >> (4 * torch.arange(INT4_PER_WORD, dtype=torch.int32))
    nib &= 0xF
    codes = nib.reshape(packed.shape[0], -1)[:, :in_features].to(torch.int8)
    del nib
    return codes.sub_(8)


def check_24_shape(in_features: int, name: str = "weight") -> None:
    if in_features % META_INPUTS:
        raise SmeltError(f"{name}: the 2:4 layout needs in_features a multiple of {META_INPUTS}, got {in_features}")


def pack_24(w: torch.Tensor, keep: torch.Tensor, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """Dense [out, in] (floats or int codes, zero where dropped) + bool keep-mask -> (values [out, in/2],
    meta int32 [out, in/32]). SmeltError if a group keeps more than 2, or holds a non-zero it drops."""
    if w.shape != keep.shape or w.ndim != 2:
        raise SmeltError(f"{name}: weight {list(w.shape)} and keep-mask {list(keep.shape)} must be one [out, in]")
    out, n = w.shape
    check_24_shape(n, name)
    if bool((w[~keep] != 0).any()):
        raise SmeltError(f"{name}: non-zero weights where the 2:4 mask drops them")
    k = keep.reshape(out, n // 4, 4)
    if bool((k.sum(-1) > 2).any()):
        raise SmeltError(f"{name}: a group of 4 keeps more than 2 (not 2:4)")
    # Choose exactly 2 slots per group: the kept positions first, then unused ones (value 0), in order;
    # a stable sort of (not kept) puts kept positions first, then sorting the chosen two orders them.
    order = torch.sort((~k).to(torch.int8), dim=-1, stable=True).indices[..., :2]
    pos = torch.sort(order, dim=-1).values  # [out, groups, 2]
    values = torch.gather(w.reshape(out, n // 4, 4), -1, pos).reshape(out, n // 2)
    nib = (pos[..., 0] | (pos[..., 1] << 2)).to(torch.int64).reshape(out, -1, GROUPS_PER_META_WORD)
    words = (nib << (4 * torch.arange(GROUPS_PER_META_WORD))).sum(-1)
    meta = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return values.contiguous(), meta


def unpack_24_positions(meta: torch.Tensor, in_features: int) -> torch.Tensor:
    """meta int32 [out, in/32] -> int64 positions [out, in/4, 2] (validated: in range, slot 0 < slot 1)."""
    check_24_shape(in_features)
    if meta.dtype != torch.int32 or meta.ndim != 2 or meta.shape[1] * META_INPUTS != in_features:
        raise SmeltError(f"2:4 meta must be int32 [out, {in_features // META_INPUTS}], got {meta.dtype} "
                         f"{list(meta.shape)}")
    nib = (meta.to(torch.int64)[..., None] >> (4 * torch.arange(GROUPS_PER_META_WORD))) & 0xF
    nib = nib.reshape(meta.shape[0], -1)
    pos = torch.stack([nib & 3, nib >> 2], dim=-1)
    if bool((pos[..., 0] >= pos[..., 1]).any()):
        raise SmeltError("2:4 meta: a group's slot positions are not increasing (corrupt metadata)")
    return pos


def unpack_24(values: torch.Tensor, meta: torch.Tensor, in_features: int) -> torch.Tensor:
    """(values [out, in/2], meta) -> dense [out, in], zeros where nothing is kept."""
    out = values.shape[0]
    if values.ndim != 2 or values.shape[1] * 2 != in_features or meta.shape[0] != out:
        raise SmeltError(f"2:4 values {list(values.shape)} and meta {list(meta.shape)} do not describe "
                         f"[{out}, {in_features}]")
    pos = unpack_24_positions(meta, in_features)
    dense = torch.zeros(out, in_features // 4, 4, dtype=values.dtype, device=values.device)
    dense.scatter_(-1, pos, values.reshape(out, -1, 2))
    return dense.reshape(out, in_features)
