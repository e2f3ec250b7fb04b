"""The M = 1 kernels (one token: decode) for W4A16, 2:4 + W4 and 2:4, reading the release's tensors in
storage order: matrix-vector products in fp32 multiply-add, no tensor cores.

Each program owns BLOCK_N output rows and a slice of K (split-K over the grid's second axis, so that a few
thousand rows still fill every SM). It loads a tile of int32 words with K contiguous (vector loads, every
word once) and one scale per row: BLOCK_K divides the quantization group, so a K block never straddles two
scales and the scale multiplies the block's sum, not every weight. Each thread holds whole rows of the K
block (Triton's layout follows the [rows, words] load for W4; the 2:4 tensors are [.., rows] with rows last
for the same reason), so the sums over K stay in registers.

Unpacking without per-nibble shifts: `w & 0xF0F0F0F0` holds the odd nibbles at the top of each byte and
`(w << 4) & 0xF0F0F0F0` the even ones; XOR with 0x80808080 turns each stored q + 8 into q, so every byte is
16 q as a signed int8 and the conversion is a byte-select int-to-float. The 16 is taken out at the end.
For 2:4 the two nibbles of a byte are one group's two kept codes (slot 0 even, slot 1 odd); each is
multiplied by the activation at its position, selected among the group's four by two metadata bits (slot 0
is at 0-2, slot 1 at 1-3: two selects each), so no dense tile is rebuilt.

Split-K writes fp32 partial sums [SPLIT, 1, N] that kernels.tile's split_sum_kernel adds in a fixed order;
with one split the program writes y directly.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels import tile

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
                      GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
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
def _sparse24_decode_kernel(x_ptr, w_ptr, meta_ptr, s_ptr, o_ptr, M, N, K, STEPS,
                            stride_xm, stride_xk, stride_wn, stride_wk, stride_mn, stride_mk,
                            stride_sn, stride_sg, stride_os, stride_om, stride_on,
                            GROUP: tl.constexpr, QUANT: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
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
        part = _sparse24_row_sums(x_ptr, w_ptr, meta_ptr, rows, k0, offs_a, offs_g, stride_xk, stride_wn, stride_wk,
                                  stride_mn, stride_mk, QUANT, A, B)[None, :]
        if QUANT:
            s = tl.load(s_ptr + rows * stride_sn + (k0 // GROUP) * stride_sg).to(tl.float32)
            acc += part * s[None, :]
        else:
            acc += part
    if QUANT:
        acc = acc * 0.0625
    _store(o_ptr, acc, offs_m, offs_n, M, N, stride_os, stride_om, stride_on)


# format -> BLOCK_N, num_warps; BLOCK_K is the largest power of two <= KMAX dividing the group.
DECODE_CONFIGS = {"w4": (512, 4), "24w4": (512, 4), "24": (256, 4)}
KMAX = {"w4": 64, "24w4": 64, "24": 128}  # the M = 1 kernels' largest K block (kernels.tile.block_k's KMIN holds)


def block_k(fmt: str, group: int) -> int:
    return tile.block_k(fmt, group, KMAX[fmt])


def supports(fmt: str, m: int, group: int) -> bool:
    return m == 1 and block_k(fmt, group) > 0


@functools.lru_cache(maxsize=256)
def plan(fmt: str, n: int, k: int, group: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, splits, K blocks per split) for one shape, computed once."""
    bn, warps = DECODE_CONFIGS[fmt]
    bk = block_k(fmt, group)
    return (bn, bk, warps, *tile.split(1, n, k, 1, bn, bk))


def decode_call(x: torch.Tensor, w: torch.Tensor, meta: torch.Tensor | None, scale: torch.Tensor | None,
                y: torch.Tensor, group: int, fmt: str) -> tuple:
    """(kernel, grid, args, options, partials or None) of the M = 1 launch for checked inputs; `fmt` is w4,
    24w4 or 24. kernels.inspect compiles exactly this."""
    (m, k), n = x.shape, y.shape[1]
    quant = scale is not None
    bn, bk, warps, split, steps = plan(fmt, n, k, group if quant else k)
    out = y if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    o_strides = (0, y.stride(0), y.stride(1)) if split == 1 else out.stride()
    opts = {"BLOCK_M": 1, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "GROUP": group if quant else 1}
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
                  y: torch.Tensor, group: int, fmt: str) -> torch.Tensor:
    """y [1, N] = x @ W.T for inputs already checked (kernels.matmul); `fmt` is w4, 24w4 or 24."""
    kernel, grid, args, opts, partials = decode_call(x, w, meta, scale, y, group, fmt)
    kernel[grid](*args, **opts)
    if partials is not None:
        tile.sum_splits(partials, y)
    return y
