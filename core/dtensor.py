"""Helpers that treat plain tensors and FSDP2 DTensor shards alike (one place for the hasattr checks)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


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


def like_part(part: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """`part`, this rank's rows of a tensor with ref's rows (read at local_slices(ref)[0]), laid out like `ref`:
    a DTensor sharded as ref is, built from the parts without communication; for a plain `ref`, the part (the
    whole) on its device. Its other dims may differ from ref's (a [out, 1] flag per row of an [out, in] weight)."""
    if hasattr(ref, "device_mesh"):
        shape = (ref.shape[0], *part.shape[1:])
        return DTensor.from_local(part.to(ref.device), ref.device_mesh, ref.placements, run_check=False,
                                  shape=torch.Size(shape), stride=torch.empty(shape, device="meta").stride())
    return part.to(ref.device)


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy a full tensor into dst in place (keeping dst's identity and sharding)."""
    local(dst).copy_(local(like(src, dst)))


def local_slices(t: torch.Tensor) -> tuple[slice, ...]:
    """Where this rank's shard of a DTensor sits in the full tensor, per dim (all of it for a plain tensor),
    so a loader can read just that part from disk."""
    if not hasattr(t, "device_mesh"):
        return tuple(slice(0, s) for s in t.shape)
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(slice(o, o + s) for o, s in zip(offset, shape))


def first_error(message: str | None) -> str | None:
    """The first rank's error message, agreed by every rank (so all raise, or none does, and rank 0, the
    one that prints, can name a problem only another rank saw). Not a collective when not distributed."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return message
    messages: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, message)
    return next((m for m in messages if m), None)
