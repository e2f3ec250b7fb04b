"""Decode kernels (M <= 16) for W4A16, 2:4 + W4 and 2:4, reading the release's tensors in storage order.

Each program owns BLOCK_N output rows and a slice of K (split-K over the grid's second axis, so that a few
thousand rows still fill every SM). It loads a tile of int32 words with K contiguous (vector loads, every
word once) and one scale per row: BLOCK_K divides the quantization group, so a K block never straddles two
scales and the scale multiplies the block's sum, not every weight.

- M = 1: a matrix-vector product in fp32 multiply-add, no tensor cores; each thread holds whole rows of
  the K block (Triton's layout follows the [rows, words] load for W4; the 2:4 tensors are [.., rows] with
  rows last for the same reason), so the sums over K stay in registers.
- 1 < M <= 16: the unpacked codes (or the 2:4 tile made dense) go through `tl.dot` with M padded to 16.

Unpacking without per-nibble shifts: `w & 0xF0F0F0F0` holds the odd nibbles at the top of each byte and
`(w << 4) & 0xF0F0F0F0` the even ones; XOR with 0x80808080 turns each stored q + 8 into q, so every byte is
16 q as a signed int8 and the conversion is a byte-select int-to-float. The 16 is taken out at the end.
For 2:4 the two nibbles of a byte are one group's two kept codes (slot 0 even, slot 1 odd); at M = 1 each
is multiplied by the activation at its position, selected among the group's four by two metadata bits
(slot 0 is at 0-2, slot 1 at 1-3: two selects each), so no dense tile is rebuilt.

Split-K writes fp32 partial sums [SPLIT, M, N] that a second small kernel adds in a fixed order (the same
result every run, no zero-filled buffer, no atomics); with one split the program writes y directly.

Import through kernels.matmul, which decides whether Triton runs interpreted (no CUDA device).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

DECODE_MAX_M = 16
SMS = 132                 # H100 SXM: the split is chosen to give every SM at least two programs
MIN_PROGRAMS = 2 * SMS
_NIB_HI = tl.constexpr(-0x0F0F0F10)  # 0xF0F0F0F0 as int32
_FLIP = tl.constexpr(-0x7F7F7F80)    # 0x80808080 as int32


@triton.jit
def _store(o_ptr, acc, offs_m, offs_n, M, N, stride_os, stride_om, stride_on):
    pid_k = tl.program_id(1)
    ptrs = o_ptr + pid_k * stride_os + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(ptrs, acc.to(o_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def _x_bytes(x_ptr, k0, offs_w, stride_xk):
    """x of a K block as 4 pairs ([WORDS] at byte b, nibble 0; [WORDS] at byte b, nibble 1): x index 8 w + i."""
    x = tl.load(x_ptr + (k0 + offs_w[:, None] * 8 + tl.arange(0, 8)[None, :]) * stride_xk).to(tl.float32)
    lo, hi = tl.split(tl.reshape(x, (x.shape[0], 2, 2, 2)))  # nibble 0 / 1, each [WORDS, c, d], byte 2 c + d
    lo02, lo13 = tl.split(lo)
    hi02, hi13 = tl.split(hi)
    lo0, lo2 = tl.split(lo02)
    lo1, lo3 = tl.split(lo13)
    hi0, hi2 = tl.split(hi02)
    hi1, hi3 = tl.split(hi13)
    return lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3


@triton.jit
def _nibbles(w):
    """Words as (even, odd): byte b holds 16 q of nibble 2 b (even) or 2 b + 1 (odd) as a signed int8."""
    return ((w << 4) & _NIB_HI) ^ _FLIP, (w & _NIB_HI) ^ _FLIP


@triton.jit
def _byte(half, b: tl.constexpr):
    """Byte b of each word as float: 16 q."""
    return (half >> (8 * b)).to(tl.int8).to(tl.float32)


@triton.jit
def _w4_decode_kernel(x_ptr, w_ptr, s_ptr, o_ptr, M, N, K, STEPS,
                      stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sg,
                      stride_os, stride_om, stride_on,
                      GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      DOT_FP32: tl.constexpr):
    WORDS: tl.constexpr = BLOCK_K // 8
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    rows = tl.where(offs_n < N, offs_n, 0)  # clamped rows load real words; their sums are never stored
    offs_w = tl.arange(0, WORDS)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    step0 = tl.program_id(1) * STEPS
    for step in range(step0, tl.minimum(step0 + STEPS, K // BLOCK_K)):
        k0 = tl.multiple_of(step * BLOCK_K, BLOCK_K)
        w = tl.load(w_ptr + rows[:, None] * stride_wn + (k0 // 8 + offs_w)[None, :] * stride_wk)
        even, odd = _nibbles(w)
        s = tl.load(s_ptr + rows * stride_sn + (k0 // GROUP) * stride_sg).to(tl.float32)
        if BLOCK_M == 1:  # one token: multiply-add in registers, each thread along its own rows
            x0, x1, x2, x3, x4, x5, x6, x7 = _x_bytes(x_ptr, k0, offs_w, stride_xk)
            t = _byte(even, 0) * x0[None, :]  # one chain: every further term is a fused multiply-add
            t = t + _byte(odd, 0) * x1[None, :]
            t = t + _byte(even, 1) * x2[None, :]
            t = t + _byte(odd, 1) * x3[None, :]
            t = t + _byte(even, 2) * x4[None, :]
            t = t + _byte(odd, 2) * x5[None, :]
            t = t + _byte(even, 3) * x6[None, :]
            t = t + _byte(odd, 3) * x7[None, :]
            acc += (tl.sum(t, 1) * s)[None, :]
        else:  # several tokens: the codes as a [BLOCK_K, BLOCK_N] tile for the tensor cores
            shifts = 8 * tl.arange(0, 4)[None, None, :]
            q = tl.join((even[:, :, None] >> shifts).to(tl.int8), (odd[:, :, None] >> shifts).to(tl.int8))
            q = tl.reshape(q, (BLOCK_N, BLOCK_K))
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                        mask=(offs_m < M)[:, None], other=0.0)
            if DOT_FP32:
                part = tl.dot(x.to(tl.float32), tl.trans(q.to(tl.float32)), input_precision="ieee")
            else:  # 16 q is exact in fp16 and bf16
                part = tl.dot(x, tl.trans(q.to(x.dtype)))
            acc += part * s[None, :]
    _store(o_ptr, acc * 0.0625, offs_m, offs_n, M, N, stride_os, stride_om, stride_on)


@triton.jit
def _sparse24_row_sums(x_ptr, w_ptr, meta_ptr, rows, k0, offs_a, offs_g, stride_xk, stride_wn, stride_wk,
                       stride_mn, stride_mk, QUANT: tl.constexpr, A: tl.constexpr, B: tl.constexpr):
    """One token: each row's sum over the K block of kept value x activation at its position, [BLOCK_N].
    Tensors are [A, B, BLOCK_N] (rows last) so that Triton's layout puts one row's groups in one thread."""
    if QUANT:
        w = tl.load(w_ptr + rows[None, :] * stride_wn + (k0 // 16 + offs_a)[:, None] * stride_wk)  # [A, BLOCK_N]
        # packed word a holds the groups of the low (even a) or high (odd a) half of metadata word a // 2
        meta = tl.load(meta_ptr + rows[None, :] * stride_mn + (k0 // 32 + offs_a // 2)[:, None] * stride_mk)
        meta = meta >> (16 * (offs_a % 2))[:, None]
        shifts = 8 * tl.arange(0, 4)[None, :, None]
        even, odd = _nibbles(w)  # slot 0, slot 1
        v0 = ((even[:, None, :] >> shifts).to(tl.int8)).to(tl.float32)
        v1 = ((odd[:, None, :] >> shifts).to(tl.int8)).to(tl.float32)
    else:
        meta = tl.load(meta_ptr + rows[None, :] * stride_mn + (k0 // 32 + offs_a)[:, None] * stride_mk)
        offs_v = k0 // 2 + offs_a[:, None] * 16 + tl.arange(0, 16)[None, :]
        v = tl.load(w_ptr + rows[None, None, :] * stride_wn + offs_v[:, :, None] * stride_wk).to(tl.float32)
        v0, v1 = tl.split(tl.permute(tl.reshape(v, (A, B, 2, rows.shape[0])), (0, 1, 3, 2)))
    nib = meta[:, None, :] >> (4 * tl.arange(0, B))[None, :, None]
    x = tl.load(x_ptr + (k0 + offs_g) * stride_xk).to(tl.float32)  # [A, B, 4]
    x02, x13 = tl.split(tl.reshape(x, (A, B, 2, 2)))
    x0, x2 = tl.split(x02)
    x1, x3 = tl.split(x13)
    # slot 0 sits at 0, 1 or 2; slot 1 at 1, 2 or 3 (slot 0 < slot 1): two selects each
    xs0 = tl.where((nib & 2) != 0, x2[:, :, None], tl.where((nib & 1) != 0, x1[:, :, None], x0[:, :, None]))
    xs1 = tl.where((nib & 8) != 0, tl.where((nib & 4) != 0, x3[:, :, None], x2[:, :, None]), x1[:, :, None])
    return tl.sum(tl.sum(v0 * xs0 + v1 * xs1, 1), 0)


@triton.jit
def _sparse24_tile_dot(x_ptr, w_ptr, meta_ptr, rows, k0, offs_a, offs_m, M, stride_xm, stride_xk, stride_wn,
                       stride_wk, stride_mn, stride_mk, QUANT: tl.constexpr, A: tl.constexpr, B: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr):
    """Several tokens: x [BLOCK_M, BLOCK_K] times the dense [BLOCK_K, BLOCK_N] tile on the tensor cores."""
    if QUANT:
        w = tl.load(w_ptr + rows[:, None] * stride_wn + (k0 // 16 + offs_a)[None, :] * stride_wk)
        meta = tl.load(meta_ptr + rows[:, None] * stride_mn + (k0 // 32 + offs_a // 2)[None, :] * stride_mk)
        meta = meta >> (16 * (offs_a % 2))[None, :]
        shifts = 8 * tl.arange(0, 4)[None, None, :]
        even, odd = _nibbles(w)
        v0 = ((even[:, :, None] >> shifts).to(tl.int8)).to(tl.float32)
        v1 = ((odd[:, :, None] >> shifts).to(tl.int8)).to(tl.float32)
    else:
        meta = tl.load(meta_ptr + rows[:, None] * stride_mn + (k0 // 32 + offs_a)[None, :] * stride_mk)
        offs_v = k0 // 2 + offs_a[:, None] * 16 + tl.arange(0, 16)[None, :]
        v = tl.load(w_ptr + rows[:, None, None] * stride_wn + offs_v[None] * stride_wk).to(tl.float32)
        v0, v1 = tl.split(tl.reshape(v, (BLOCK_N, A, B, 2)))
    nib = meta[:, :, None] >> (4 * tl.arange(0, B))[None, None, :]
    lo0, hi0, lo1, hi1 = (nib & 1) != 0, (nib & 2) != 0, (nib & 4) != 0, (nib & 8) != 0
    d0 = tl.where(lo0 | hi0, 0.0, v0)
    d1 = tl.where(lo0 & ~hi0, v0, tl.where(lo1 & ~hi1, v1, 0.0))
    d2 = tl.where(hi0 & ~lo0, v0, tl.where(hi1 & ~lo1, v1, 0.0))
    d3 = tl.where(lo1 & hi1, v1, 0.0)
    dense = tl.reshape(tl.join(tl.join(d0, d2), tl.join(d1, d3)), (BLOCK_N, BLOCK_K))
    offs_k = k0 + tl.arange(0, BLOCK_K)
    xt = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk, mask=(offs_m < M)[:, None],
                 other=0.0)
    if DOT_FP32:
        return tl.dot(xt.to(tl.float32), tl.trans(dense), input_precision="ieee")
    return tl.dot(xt, tl.trans(dense.to(xt.dtype)))


@triton.jit
def _sparse24_decode_kernel(x_ptr, w_ptr, meta_ptr, s_ptr, o_ptr, M, N, K, STEPS,
                            stride_xm, stride_xk, stride_wn, stride_wk, stride_mn, stride_mk,
                            stride_sn, stride_sg, stride_os, stride_om, stride_on,
                            GROUP: tl.constexpr, QUANT: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            DOT_FP32: tl.constexpr):
    # A K block is [A, B] groups of 4 inputs: with int4 codes A = packed words (16 inputs, 4 groups each),
    # else A = metadata words (32 inputs, 8 groups each). Group b of A's metadata sits at bits 4 b (+16
    # for the odd packed word of a metadata word).
    B: tl.constexpr = 4 if QUANT else 8
    A: tl.constexpr = BLOCK_K // (4 * B)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    rows = tl.where(offs_n < N, offs_n, 0)  # clamped rows load real words; their sums are never stored
    offs_a = tl.arange(0, A)
    offs_g = offs_a[:, None, None] * (4 * B) + tl.arange(0, B)[None, :, None] * 4 + tl.arange(0, 4)[None, None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    step0 = tl.program_id(1) * STEPS
    for step in range(step0, tl.minimum(step0 + STEPS, K // BLOCK_K)):
        k0 = tl.multiple_of(step * BLOCK_K, BLOCK_K)
        if BLOCK_M == 1:
            part = _sparse24_row_sums(x_ptr, w_ptr, meta_ptr, rows, k0, offs_a, offs_g, stride_xk, stride_wn, stride_wk,
                                      stride_mn, stride_mk, QUANT, A, B)[None, :]
        else:
            part = _sparse24_tile_dot(x_ptr, w_ptr, meta_ptr, rows, k0, offs_a, offs_m, M, stride_xm, stride_xk,
                                      stride_wn, stride_wk, stride_mn, stride_mk, QUANT, A, B, BLOCK_N, BLOCK_K,
                                      DOT_FP32)
        if QUANT:
            s = tl.load(s_ptr + rows * stride_sn + (k0 // GROUP) * stride_sg).to(tl.float32)
            acc += part * s[None, :]
        else:
            acc += part
    if QUANT:
        acc = acc * 0.0625
    _store(o_ptr, acc, offs_m, offs_n, M, N, stride_os, stride_om, stride_on)


@triton.jit
def _split_sum_kernel(p_ptr, y_ptr, SPLIT, MN, BLOCK: tl.constexpr):
    """y = the sum over splits of partials [SPLIT, M * N], in split order."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT):
        acc += tl.load(p_ptr + s * MN + offs, mask=ok, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


# (format, BLOCK_M) -> BLOCK_N, num_warps; BLOCK_K is the largest power of two <= KMAX dividing the group.
DECODE_CONFIGS = {("w4", 1): (512, 4), ("w4", 16): (128, 4), ("24w4", 1): (512, 4), ("24w4", 16): (128, 4),
                  ("24", 1): (256, 4), ("24", 16): (32, 4)}
KMAX = {"w4": 64, "24w4": 64, "24": 128}
KMIN = {"w4": 8, "24w4": 32, "24": 32}  # one packed word; one metadata word
SUM_BLOCK = 1024


def block_m(m: int) -> int:
    """1 for the matrix-vector path; the tensor-core path pads M to 16, the smallest `tl.dot` tile."""
    return 1 if m == 1 else DECODE_MAX_M


def block_k(fmt: str, group: int) -> int:
    """The K block: a power of two that divides the group (one scale per block; for 2:4 without scales,
    pass K: no tail); 0 if none fits."""
    bk = KMAX[fmt]
    while bk >= KMIN[fmt] and group % bk:
        bk //= 2
    return bk if bk >= KMIN[fmt] else 0


def supports(fmt: str, m: int, group: int) -> bool:
    return 0 < m <= DECODE_MAX_M and block_k(fmt, group) > 0


@functools.lru_cache(maxsize=256)
def plan(fmt: str, m: int, n: int, k: int, group: int) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, splits, K blocks per split) for one shape, computed once."""
    bm = block_m(m)
    bn, warps = DECODE_CONFIGS[(fmt, bm)]
    bk = block_k(fmt, group)
    steps = triton.cdiv(k, bk)
    per = max(1, steps // triton.cdiv(MIN_PROGRAMS, triton.cdiv(n, bn)))  # K blocks per split, rounded down
    return bm, bn, bk, warps, triton.cdiv(steps, per), per


def decode_call(x: torch.Tensor, w: torch.Tensor, meta: torch.Tensor | None, scale: torch.Tensor | None,
                y: torch.Tensor, group: int, fmt: str, dot_fp32: bool) -> tuple:
    """(kernel, grid, args, options, partials or None) of the decode launch for checked inputs; `fmt` is w4,
    24w4 or 24. kernels.inspect compiles exactly this."""
    (m, k), n = x.shape, y.shape[1]
    quant = scale is not None
    bm, bn, bk, warps, split, steps = plan(fmt, m, n, k, group if quant else k)
    out = y if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    o_strides = (0, y.stride(0), y.stride(1)) if split == 1 else out.stride()
    opts = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "GROUP": group if quant else 1,
            "DOT_FP32": dot_fp32}
    s = scale if quant else w  # an unused pointer without scales
    s_strides = (s.stride(0), s.stride(1)) if quant else (0, 0)
    if fmt == "w4":
        kernel, args = _w4_decode_kernel, (x, w, s, out, m, n, k, steps, *x.stride(), *w.stride(), *s_strides,
                                           *o_strides)
    else:
        kernel, args = _sparse24_decode_kernel, (x, w, meta, s, out, m, n, k, steps, *x.stride(), *w.stride(),
                                                 *meta.stride(), *s_strides, *o_strides)
        opts["QUANT"] = quant
    return kernel, (triton.cdiv(n, bn), split), args, opts, None if split == 1 else out


def decode_launch(x: torch.Tensor, w: torch.Tensor, meta: torch.Tensor | None, scale: torch.Tensor | None,
                  y: torch.Tensor, group: int, fmt: str, dot_fp32: bool) -> torch.Tensor:
    """y [M, N] = x @ W.T for inputs already checked (kernels.matmul); `fmt` is w4, 24w4 or 24; dot_fp32: the
    tensor-core path (M > 1) in fp32 (the interpreter, fp32 activations)."""
    kernel, grid, args, opts, partials = decode_call(x, w, meta, scale, y, group, fmt, dot_fp32)
    kernel[grid](*args, **opts)
    if partials is not None:
        mn = y.numel()
        _split_sum_kernel[(triton.cdiv(mn, SUM_BLOCK),)](partials, y, partials.shape[0], mn, BLOCK=SUM_BLOCK)
    return y
