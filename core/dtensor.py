"""Helpers that treat plain tensors and FSDP2 DTensor shards alike (one place for the hasattr checks)."""
from __future__ import annotations

import torch
from torch.distributed.tensor import distribute_tensor


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor, or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (a collective when sharded), or the tensor itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def like(src: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """A full tensor laid out like `ref`: on its device, and sharded the same way if ref is a DTensor."""
    if hasattr(ref, "device_mesh"):
        return distribute_tensor(src.to(ref.device), ref.device_mesh, ref.placements)
    return src.to(ref.device)


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy a full tensor into dst in place (keeping dst's identity and sharding)."""
    local(dst).copy_(local(like(src, dst)))
