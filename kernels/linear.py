"""A Linear whose weight stays in a kernel layout: W4A16, 2:4, or 2:4 + W4, with declared dense rows of a
2:4 module (protected heads) on the dense path of the same precision.

Built from what the release stores (core.release_layout.ReleaseLinear) or from a pruned artifact's weight and
keep-mask; the 2:4 structure is checked once here (core.packing), never per call.

2:4 on 16-bit values at M > SMALL_M on a GPU goes to PyTorch's semi-structured sparse tensors (cuSPARSELt):
there the matmul is compute-bound, and the sparse tensor cores do half the multiply-adds, where the Triton
tile rebuilds the dense tile. The semi-structured copy is built from the stored values on first use (it
holds as many bytes again); where it cannot be built (shape, PyTorch build) the Triton tile runs.
"""
from __future__ import annotations

import torch
from torch import nn

from core.packing import pack_24, pack_int4, unpack_24, unpack_24_positions
from core.release_layout import ReleaseLinear
from kernels.matmul import SMALL_M, sparse24_matmul, sparse24_w4a16_matmul, w4a16_matmul


def uses_cusparselt(m: int, x: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether 2:4 `values` at M tokens of x go to PyTorch's semi-structured matmul: 16-bit values of x's
    dtype, on a GPU, past the decode-sized M that the Triton kernel's split-K serves."""
    return (m > SMALL_M and x.device.type == "cuda" and x.dtype == values.dtype
            and values.dtype in (torch.float16, torch.bfloat16))


def semi_structured(dense: torch.Tensor) -> torch.Tensor:
    from torch.sparse import to_sparse_semi_structured

    return to_sparse_semi_structured(dense)


class KernelLinear(nn.Module):
    """y = x @ W.T (+ bias), W in `kind` ("w4", "2:4", "2:4+w4"); rows listed in `dense_idx` take the dense path."""

    def __init__(self, in_features: int, out_features: int, kind: str, group_size: int = 0,
                 bias: torch.Tensor | None = None):
        super().__init__()
        self.in_features, self.out_features, self.kind, self.group_size = in_features, out_features, kind, group_size
        self._paths: list[str] = []  # "w4" / "s24w4" / "s24" / "dense"; with several, each has <path>_rows
        self._semi: torch.Tensor | bool | None = None  # the s24 weight for cuSPARSELt; False: cannot be built
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
            if uses_cusparselt(x.shape[0], x, b("values")) and (semi := self._semi_weight()) is not False:
                return nn.functional.linear(x, semi)
            return sparse24_matmul(x, b("values"), b("meta"))
        return x @ b("weight").to(x.dtype).T  # dense rows of an unquantized 2:4 module

    def _semi_weight(self) -> torch.Tensor | bool:
        """The s24 rows as a semi-structured sparse tensor, built once; False where PyTorch refuses them."""
        if self._semi is None:
            try:
                self._semi = semi_structured(unpack_24(self.s24_values, self.s24_meta, self.in_features))
            except (RuntimeError, ValueError, ImportError):  # shape, dtype or build: the Triton tile runs
                self._semi = False
        return self._semi

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
