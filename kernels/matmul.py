"""Triton matmuls for the release's weights: y = x @ W.T with W stored as

- W4A16:     int4 codes packed 8 per int32 word along the input dim + per-group symmetric scales
             (compressed-tensors pack-quantized, read in place: no repacking);
- 2:4:       the kept half of each row + 4 bits of position metadata per group of 4 (core.packing);
- 2:4 + W4:  the kept half as int4 codes (packed the same way) + the metadata + the W4 scales.

At M <= 16 the entry points run kernels.decode (split-K matrix-vector products over the stored words);
above, one kernel does all three: each program rebuilds a [BLOCK_K, BLOCK_N] tile of W.T in registers
(unpack codes, place the kept values at their positions, scale) and feeds it to `tl.dot` with fp32
accumulation. Triton has no sparse tensor-core instruction, so the 2:4 paths win only by reading fewer
bytes, which matters where a matmul is memory-bound: decode (small M). At large M the tile rebuild is
extra work on top of a dense-speed dot.

On a machine without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set here when
no CUDA device exists) with dots in fp32: the interpreter's low-precision `tl.dot` is not trustworthy.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before triton decorates anything: the interpreter is the CPU path
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton
import triton.language as tl

from core.errors import SmeltError
from core.packing import INT4_PER_WORD, META_INPUTS
from kernels import decode

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _tile_values(w_ptr, r, offs_n, stride_wr, stride_wn, mask, QUANT: tl.constexpr):
    """Stored values at kept/input index r ([BLOCK_K, 1]) for columns offs_n: codes (QUANT) or values."""
    if QUANT:
        word = tl.load(w_ptr + (r // 8) * stride_wr + offs_n[None, :] * stride_wn, mask=mask, other=0)
        return (((word >> ((r % 8) * 4)) & 0xF) - 8).to(tl.float32)
    else:
        return tl.load(w_ptr + r * stride_wr + offs_n[None, :] * stride_wn, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _matmul_kernel(x_ptr, w_ptr, meta_ptr, s_ptr, y_ptr, M, N, K,
                   stride_xm, stride_xk, stride_wr, stride_wn, stride_mr, stride_mn,
                   stride_sg, stride_sn, stride_ym, stride_yn,
                   GROUP: tl.constexpr, QUANT: tl.constexpr, SPARSE: tl.constexpr, DOT_FP32: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m[:, None] < M
    n_mask = offs_n[None, :] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=m_mask & (offs_k[None, :] < K), other=0.0)
        k = offs_k[:, None]
        kn_mask = (k < K) & n_mask  # a K tail past the last tile reads nothing
        if SPARSE:
            # group g = k // 4 keeps slots 2g and 2g+1; its positions sit at bits 4*(g%8) of meta word k // 32
            meta = tl.load(meta_ptr + (k // 32) * stride_mr + offs_n[None, :] * stride_mn, mask=kn_mask, other=0)
            shift = ((k // 4) % 8) * 4
            p0 = (meta >> shift) & 3
            p1 = (meta >> (shift + 2)) & 3
            v0 = _tile_values(w_ptr, (k // 4) * 2, offs_n, stride_wr, stride_wn, kn_mask, QUANT)
            v1 = _tile_values(w_ptr, (k // 4) * 2 + 1, offs_n, stride_wr, stride_wn, kn_mask, QUANT)
            w = tl.where((k % 4) == p0, v0, tl.where((k % 4) == p1, v1, 0.0))
        else:
            w = _tile_values(w_ptr, k, offs_n, stride_wr, stride_wn, kn_mask, QUANT)
        if QUANT:
            s = tl.load(s_ptr + (k // GROUP) * stride_sg + offs_n[None, :] * stride_sn, mask=kn_mask, other=0.0)
            w = w * s.to(tl.float32)
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), w)
        else:
            acc += tl.dot(x, w.to(x.dtype))
    y = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn, y, mask=m_mask & n_mask)


# Tuning space on a GPU (small and stated): decode shapes want narrow M and wide K tiles, prefill square tiles.
GPU_CONFIGS = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
               for bm, bn, bk, w, s in [(16, 64, 128, 4, 4), (16, 128, 64, 4, 4), (16, 32, 256, 4, 3),
                                        (64, 64, 64, 4, 4), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3),
                                        (64, 128, 128, 4, 3)]]
_tuned = triton.autotune(GPU_CONFIGS, key=["M", "N", "K", "QUANT", "SPARSE"])(_matmul_kernel)
INTERPRET_BLOCK = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64}


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise SmeltError(msg)


def check_inputs(x: torch.Tensor, w: torch.Tensor, meta: torch.Tensor | None, scale: torch.Tensor | None,
                 out_features: int, group_size: int, quant: bool, sparse: bool) -> None:
    """Every shape, dtype and device of one matmul's inputs, one SmeltError line before any launch."""
    _check(x.ndim == 2 and x.dtype in ACT_DTYPES, f"x must be 2-D float16/bfloat16/float32, got {x.dtype} "
           f"{list(x.shape)}")
    K = x.shape[1]
    devices = {t.device for t in (x, w, meta, scale) if t is not None}
    _check(len(devices) == 1, f"kernel inputs on several devices: {sorted(map(str, devices))}")
    _check(x.is_cuda or INTERPRET, "the Triton kernels need a CUDA device or TRITON_INTERPRET=1")
    if not x.is_cuda:  # the interpreter runs on host memory only
        _check(x.device.type == "cpu", f"interpreter inputs must be on the CPU, got {x.device}")
    stored = K // 2 if sparse else K  # inputs of a row actually stored
    if quant:
        _check(w.dtype == torch.int32 and tuple(w.shape) == (out_features, stored // INT4_PER_WORD),
               f"packed weight must be int32 [{out_features}, {stored // INT4_PER_WORD}] for x {list(x.shape)}, "
               f"got {w.dtype} {list(w.shape)}")
        _check(group_size > 0 and K % group_size == 0, f"group_size {group_size} must divide in_features {K}")
        _check(scale is not None and scale.is_floating_point()
               and tuple(scale.shape) == (out_features, K // group_size),
               f"scale must be float [{out_features}, {K // group_size}] (group_size {group_size}), got "
               f"{None if scale is None else (scale.dtype, list(scale.shape))}")
        _check(stored % INT4_PER_WORD == 0, f"in_features {K} does not fill whole int4 words")
    else:
        _check(w.is_floating_point() and tuple(w.shape) == (out_features, stored),
               f"weight values must be float [{out_features}, {stored}], got {w.dtype} {list(w.shape)}")
    if sparse:
        _check(K % META_INPUTS == 0, f"2:4 needs in_features a multiple of {META_INPUTS}, got {K}")
        _check(meta is not None and meta.dtype == torch.int32
               and tuple(meta.shape) == (out_features, K // META_INPUTS),
               f"2:4 meta must be int32 [{out_features}, {K // META_INPUTS}], got "
               f"{None if meta is None else (meta.dtype, list(meta.shape))}")


def _launch(x: torch.Tensor, w: torch.Tensor, meta: torch.Tensor | None, scale: torch.Tensor | None,
            out_features: int, group_size: int, quant: bool, sparse: bool) -> torch.Tensor:
    check_inputs(x, w, meta, scale, out_features, group_size, quant, sparse)
    M, K = x.shape
    y = torch.empty(M, out_features, dtype=x.dtype, device=x.device)
    if M == 0 or out_features == 0:
        return y
    fmt = ("24w4" if sparse else "w4") if quant else "24"
    if decode.supports(fmt, M, group_size if quant else K):  # small M, a group their K block divides
        return decode.decode_launch(x, w, meta, scale, y, group_size, fmt,
                                    dot_fp32=INTERPRET or x.dtype == torch.float32)
    meta_t = meta if sparse else w  # unused pointer when dense
    scale_t = scale if quant else w
    args = (x, w, meta_t, scale_t, y, M, out_features, K,
            x.stride(0), x.stride(1), w.stride(1), w.stride(0), meta_t.stride(1), meta_t.stride(0),
            scale_t.stride(1) if quant else 0, scale_t.stride(0) if quant else 0, y.stride(0), y.stride(1))
    flags = dict(GROUP=group_size if quant else 1, QUANT=quant, SPARSE=sparse, DOT_FP32=INTERPRET or x.dtype == torch.float32)
    if INTERPRET:
        grid = (triton.cdiv(M, INTERPRET_BLOCK["BLOCK_M"]), triton.cdiv(out_features, INTERPRET_BLOCK["BLOCK_N"]))
        _matmul_kernel[grid](*args, **flags, **INTERPRET_BLOCK)
    else:
        grid = lambda meta_: (triton.cdiv(M, meta_["BLOCK_M"]), triton.cdiv(out_features, meta_["BLOCK_N"]))
        _tuned[grid](*args, **flags)
    return y


def w4a16_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """x [M, K] @ W.T, W = q * scale: packed int32 [N, K/8] (pack-quantized), scale [N, K/group_size]."""
    return _launch(x, packed, None, scale, packed.shape[0], group_size, quant=True, sparse=False)


def sparse24_matmul(x: torch.Tensor, values: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ W.T, W 2:4: values [N, K/2] and meta int32 [N, K/32] (core.packing.pack_24)."""
    return _launch(x, values, meta, None, values.shape[0], 0, quant=False, sparse=True)


def sparse24_w4a16_matmul(x: torch.Tensor, packed: torch.Tensor, meta: torch.Tensor, scale: torch.Tensor,
                          group_size: int) -> torch.Tensor:
    """x [M, K] @ W.T, W 2:4 with int4 kept codes: packed int32 [N, K/16], meta [N, K/32], scale [N, K/g]."""
    return _launch(x, packed, meta, scale, packed.shape[0], group_size, quant=True, sparse=True)
