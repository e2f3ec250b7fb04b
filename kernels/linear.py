"""A Linear whose weight stays in a kernel layout: W4A16, 2:4, or 2:4 + W4, with declared dense rows of a
2:4 module (protected heads) on the dense path of the same precision.

Built from what the release stores (core.release_layout.ReleaseLinear) or from a pruned artifact's weight and
keep-mask; the 2:4 structure is checked once here (core.packing), never per call.
"""
from __future__ import annotations

import torch
from torch import nn

from core.packing import pack_24, pack_int4, unpack_24_positions
from core.release_layout import ReleaseLinear
from kernels.matmul import sparse24_matmul, sparse24_w4a16_matmul, w4a16_matmul


class KernelLinear(nn.Module):
    """y = x @ W.T (+ bias), W in `kind` ("w4", "2:4", "2:4+w4"); rows listed in `dense_idx` take the dense path."""

    def __init__(self, in_features: int, out_features: int, kind: str, group_size: int = 0,
                 bias: torch.Tensor | None = None):
        super().__init__()
        self.in_features, self.out_features, self.kind, self.group_size = in_features, out_features, kind, group_size
        self._paths: list[str] = []  # "w4" / "s24w4" / "s24" / "dense"; with several, each has <path>_rows
        self.register_buffer("bias", None if bias is None else bias.detach().clone())  # Qwen2's q/k/v

    def _add(self, path: str, rows: torch.Tensor | None, **tensors: torch.Tensor) -> None:
        for k, v in tensors.items():
            self.register_buffer(f"{path}_{k}", v.contiguous())
        if rows is not None:
            self.register_buffer(f"{path}_rows", rows)
        self._paths.append(path)

    @classmethod
    def from_release(cls, lin: ReleaseLinear, scale_dtype: torch.dtype = torch.float32,
                     bias: torch.Tensor | None = None) -> KernelLinear:
        out, inn = lin.shape
        m = cls(inn, out, "2:4+w4" if lin.sparse else "w4", lin.group_size, bias)
        scale = lin.scale.to(scale_dtype)
        if not lin.sparse:
            m._add("w4", None, packed=lin.packed, scale=scale)
            return m
        sparse_idx, dense_idx = lin.rows()
        if lin.meta is not None:  # compressed storage: the kernel's layout already
            unpack_24_positions(lin.meta, inn)  # validates the metadata
            kept, meta, dense_packed = lin.kept, lin.meta, lin.dense_packed
        else:
            codes = lin.codes()
            vq, meta = pack_24(codes[sparse_idx], lin.keep[sparse_idx], lin.name)
            kept, dense_packed = pack_int4(vq), lin.packed[dense_idx]
        whole = len(dense_idx) == 0
        m._add("s24w4", None if whole else sparse_idx, packed=kept, meta=meta, scale=scale[sparse_idx])
        if not whole:
            m._add("w4", dense_idx, packed=dense_packed, scale=scale[dense_idx])
        return m

    @classmethod
    def from_pruned(cls, weight: torch.Tensor, keep: torch.Tensor, dense_rows: torch.Tensor | None = None,
                    name: str = "weight", bias: torch.Tensor | None = None) -> KernelLinear:
        """A 2:4 (not quantized) Linear from a pruned artifact: values + metadata in the weight's dtype."""
        out, inn = weight.shape
        m = cls(inn, out, "2:4", bias=bias)
        dense = dense_rows if dense_rows is not None else torch.zeros(out, dtype=torch.bool)
        sparse_idx, dense_idx = (~dense).nonzero().flatten(), dense.nonzero().flatten()
        values, meta = pack_24(weight[sparse_idx], keep[sparse_idx].bool(), name)
        whole = len(dense_idx) == 0
        m._add("s24", None if whole else sparse_idx, values=values, meta=meta)
        if not whole:
            m._add("dense", dense_idx, weight=weight[dense_idx])
        return m

    def _run(self, path: str, x: torch.Tensor) -> torch.Tensor:
        b = lambda k: getattr(self, f"{path}_{k}")
        if path == "w4":
            return w4a16_matmul(x, b("packed"), b("scale"), self.group_size)
        if path == "s24w4":
            return sparse24_w4a16_matmul(x, b("packed"), b("meta"), b("scale"), self.group_size)
        if path == "s24":
            return sparse24_matmul(x, b("values"), b("meta"))
        return x @ b("weight").to(x.dtype).T  # dense rows of an unquantized 2:4 module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if len(self._paths) == 1:
            y = self._run(self._paths[0], x2)
        else:
            y = x2.new_empty(x2.shape[0], self.out_features)
            for path in self._paths:
                y[:, getattr(self, f"{path}_rows")] = self._run(path, x2)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.kind}" + (
            f", group {self.group_size}" if self.group_size else "") + (
            ", dense rows on the dense path" if len(self._paths) > 1 else "")
