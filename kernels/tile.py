"""The tensor-core kernel (M > 1) for bf16, W4A16, 2:4 and 2:4 + W4 weights, read in storage order.

Each program owns a [BLOCK_M, BLOCK_N] output tile and a slice of K (split-K over the grid's second axis
when the tiles alone would leave SMs idle: decode-sized M). Per K block it loads the weight rows with K
contiguous (16-byte vector loads, every byte once), one scale per row and group (BLOCK_K divides the
quantization group, or in the small swapped tile spans two), rebuilds the [BLOCK_N, BLOCK_K] bf16 tile in registers and runs `tl.dot` with fp32 accumulation
(wgmma on sm_90). For decode-sized M the dot is swapped, W x.T: the weight rows take the tensor core's
64-row side and the tokens its narrow side (16, 32 or 64), so a batch of 16 does no padded multiply-adds.

W4 codes become bf16 without a conversion instruction: `(w >> 4 i) & 0x000F000F | 0x43004300` puts codes i
and i + 4 of a word into one register as the bf16 bits of 128 + code; subtracting 136 is exact (bf16 holds
every integer up to 256), so one bf16x2 add and one bf16x2 multiply by the scale give round(q * scale),
the same bf16 value the fp32 path rounds to. The interpreter's bf16 arithmetic is not trustworthy, so there
(and for fp32 activations) the subtract and multiply run in fp32.

2:4 + W4: each group's two kept codes go to their positions (the metadata's two 2-bit fields) by shifting
them into the 16-bit lanes of one 64-bit word, no selects; the dense codes then take W4's path. 2:4 on 16-bit
values is placed the same way (a group's kept pair is one 32-bit word); fp32 values by selects. Triton has no
sparse tensor-core instruction: 2:4 saves bytes, not multiply-adds.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

SMALL_M = 64              # up to this M, kernels.matmul runs the swapped tile with split-K (decode-sized batches)
SMS = 132                 # H100 SXM: a small grid is split along K so that its waves of programs fill the SMs
BF16_128X2 = 0x43004300   # bf16 128.0 in both halves of a word: passed as an argument, so that ptxas keeps
#                           it in a register and fuses mask and or into one LOP3


@triton.jit
def _w4_codes(w, magic, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Words [BLOCK_N, BLOCK_K / 8] -> [BLOCK_N, BLOCK_K] bf16 holding 128 + stored code (q + 136), K order."""
    w = w.to(tl.uint32, bitcast=True)
    t0 = (w & 0x000F000F) | magic        # codes 0 (low half) and 4 (high half)
    t1 = ((w >> 4) & 0x000F000F) | magic  # 1 and 5
    t2 = ((w >> 8) & 0x000F000F) | magic  # 2 and 6
    t3 = ((w >> 12) & 0x000F000F) | magic  # 3 and 7
    t = tl.join(tl.join(t0, t2), tl.join(t1, t3))  # [.., a, b]: code 2 a + b, and 2 a + b + 4
    v = tl.join(t.to(tl.uint16), (t >> 16).to(tl.uint16))  # [.., a, b, h]: code 4 h + 2 a + b
    v = tl.permute(v, (0, 1, 4, 2, 3))
    return tl.reshape(v, (BLOCK_N, BLOCK_K)).to(tl.bfloat16, bitcast=True)


@triton.jit
def _dequant(v, s, FP32: tl.constexpr, DTYPE: tl.constexpr):
    """(128 + code - 136) x scale: exact subtract, one rounding; s broadcasts over v's trailing dims."""
    if FP32:
        return ((v.to(tl.float32) - 136.0) * s.to(tl.float32)).to(DTYPE)
    return ((v - 136.0) * s.to(tl.bfloat16)).to(DTYPE)


@triton.jit
def _place(t, nib):
    """One 2:4 group of 16-bit lanes: t (uint32) holds slot 0 in its low half and slot 1 in its high half, nib
    their positions (bits 0-1 and 2-3). Returns the dense group as two uint32 (inputs 0-1, inputs 2-3), each
    slot shifted to its lane of one 64-bit word: no selects; free lanes are 0."""
    g = ((t & 0xFFFF).to(tl.uint64) << ((nib & 3) * 16).to(tl.uint64)) | \
        ((t >> 16).to(tl.uint64) << (((nib >> 2) & 3) * 16).to(tl.uint64))
    return g.to(tl.uint32), (g >> 32).to(tl.uint32)


@triton.jit
def _dense24_codes(w, meta, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """2:4 + W4 words [BLOCK_N, A] (4 groups each; group j = nibbles 2j, 2j+1 = slot 0, slot 1) and each word's
    16 metadata bits -> the dense [BLOCK_N, BLOCK_K] codes as bf16 bits of 128 + code, a free position holding
    136 (code 8: weight 0). Placed as code ^ 8, whose free lanes are 0, then turned back with one xor."""
    w = w.to(tl.uint32, bitcast=True)
    meta = meta.to(tl.uint32, bitcast=True)
    l0, h0 = _place(((w & 0xF) | ((w << 12) & 0xF0000)) ^ 0x80008, meta)
    l1, h1 = _place((((w >> 8) & 0xF) | ((w << 4) & 0xF0000)) ^ 0x80008, meta >> 4)
    l2, h2 = _place((((w >> 16) & 0xF) | ((w >> 4) & 0xF0000)) ^ 0x80008, meta >> 8)
    l3, h3 = _place((((w >> 24) & 0xF) | ((w >> 12) & 0xF0000)) ^ 0x80008, meta >> 12)
    q = tl.join(tl.join(tl.join(l0, h0), tl.join(l2, h2)), tl.join(tl.join(l1, h1), tl.join(l3, h3)))
    q = q ^ 0x43084308  # [.., half, c, d]: group 2 c + d, inputs 2 half, 2 half + 1
    v = tl.join(q.to(tl.uint16), (q >> 16).to(tl.uint16))  # [.., half, c, d, e]: input 2 half + e
    return tl.reshape(tl.permute(v, (0, 1, 3, 4, 2, 5)), (BLOCK_N, BLOCK_K)).to(tl.bfloat16, bitcast=True)


@triton.jit
def _place24(v0, v1, meta, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """2:4 values (any width) [BLOCK_N, A, B] and their metadata nibbles -> the dense [BLOCK_N, BLOCK_K] tile by
    selects. Slot 0 sits at 0-2 (bits 0-1), slot 1 at 1-3 (bits 2-3)."""
    lo0, hi0, lo1, hi1 = (meta & 1) != 0, (meta & 2) != 0, (meta & 4) != 0, (meta & 8) != 0
    zero = tl.zeros_like(v0)
    d0 = tl.where(lo0 | hi0, zero, v0)
    d1 = tl.where(lo0 & ~hi0, v0, tl.where(lo1 & ~hi1, v1, zero))
    d2 = tl.where(hi0 & ~lo0, v0, tl.where(hi1 & ~lo1, v1, zero))
    d3 = tl.where(lo1 & hi1, v1, zero)
    return tl.reshape(tl.join(tl.join(d0, d2), tl.join(d1, d3)), (BLOCK_N, BLOCK_K))


@triton.jit
def _weight_tile(w_ptr, meta_ptr, s_ptr, magic, rows, k0, stride_wn, stride_wk, stride_mn, stride_mk,
                 stride_sn, stride_sg, GROUP: tl.constexpr, QUANT: tl.constexpr, SPARSE: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP32: tl.constexpr, DTYPE: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] tile of W at K offset k0 in DTYPE, from the stored tensors in storage order."""
    if QUANT:
        if BLOCK_K > GROUP:  # the block spans groups: each group's scale repeated over its inputs
            NG: tl.constexpr = BLOCK_K // GROUP
            s = tl.load(s_ptr + rows[:, None] * stride_sn + (k0 // GROUP + tl.arange(0, NG))[None, :] * stride_sg)
            s = tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, NG, GROUP)), (BLOCK_N, BLOCK_K))
        else:  # one scale per row: BLOCK_K divides the group
            s = tl.load(s_ptr + rows * stride_sn + (k0 // GROUP) * stride_sg)[:, None]
    if SPARSE:
        # a K block is [A, B] groups of 4 inputs: with int4 codes A = packed words (16 inputs, 4 groups each),
        # else A = metadata words (32 inputs, 8 groups); group b of A's metadata sits at bits 4 b (+16 for the
        # odd packed word of a metadata word)
        B: tl.constexpr = 4 if QUANT else 8
        A: tl.constexpr = BLOCK_K // (4 * B)
        offs_a = tl.arange(0, A)
        if QUANT:
            w = tl.load(w_ptr + rows[:, None] * stride_wn + (k0 // 16 + offs_a)[None, :] * stride_wk)
            meta = tl.load(meta_ptr + rows[:, None] * stride_mn + (k0 // 32 + tl.arange(0, A // 2))[None, :] * stride_mk)
            meta = tl.reshape(tl.join(meta, meta >> 16), (BLOCK_N, A))  # packed word a: half a % 2 of word a // 2
            return _dequant(_dense24_codes(w, meta, BLOCK_N, BLOCK_K), s, FP32, DTYPE)
        else:
            meta = tl.load(meta_ptr + rows[:, None] * stride_mn + (k0 // 32 + offs_a)[None, :] * stride_mk)
            nib = meta[:, :, None] >> (4 * tl.arange(0, B))[None, None, :]
            if w_ptr.dtype.element_ty.primitive_bitwidth == 16:  # a group's kept pair is one 32-bit word
                words = w_ptr.to(tl.pointer_type(tl.uint32))
                offs_g = k0 // 4 + offs_a[:, None] * B + tl.arange(0, B)[None, :]
                t = tl.load(words + rows[:, None, None] * (stride_wn // 2) + offs_g[None])
                lo, hi = _place(t, nib.to(tl.uint32, bitcast=True))
                q = tl.join(lo, hi)  # [.., half]: inputs 0-1, 2-3 of the group
                v = tl.join(q.to(tl.uint16), (q >> 16).to(tl.uint16))
                return tl.reshape(v, (BLOCK_N, BLOCK_K)).to(w_ptr.dtype.element_ty, bitcast=True).to(DTYPE)
            else:  # 32-bit values: placed by selects
                offs_v = k0 // 2 + offs_a[:, None] * 16 + tl.arange(0, 16)[None, :]
                v = tl.load(w_ptr + rows[:, None, None] * stride_wn + offs_v[None] * stride_wk).to(DTYPE)
                v0, v1 = tl.split(tl.reshape(v, (BLOCK_N, A, B, 2)))
                return _place24(v0, v1, nib, BLOCK_N, BLOCK_K)
    if QUANT:
        w = tl.load(w_ptr + rows[:, None] * stride_wn + (k0 // 8 + tl.arange(0, BLOCK_K // 8))[None, :] * stride_wk)
        return _dequant(_w4_codes(w, magic, BLOCK_N, BLOCK_K), s, FP32, DTYPE)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    return tl.load(w_ptr + rows[:, None] * stride_wn + offs_k[None, :] * stride_wk).to(DTYPE)


@triton.jit
def tile_kernel(x_ptr, w_ptr, meta_ptr, s_ptr, o_ptr, magic, M, N, K, STEPS,
                stride_xm, stride_xk, stride_wn, stride_wk, stride_mn, stride_mk, stride_sn, stride_sg,
                stride_os, stride_om, stride_on, M_BUCKET,
                GROUP: tl.constexpr, QUANT: tl.constexpr, SPARSE: tl.constexpr, DOT_FP32: tl.constexpr,
                DEQUANT_FP32: tl.constexpr, SWAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """o[split] = x @ W.T over this program's K slice; grid (N blocks, splits, M blocks). DOT_FP32: the dot in
    ieee fp32 (the interpreter, fp32 activations); DEQUANT_FP32: codes x scales in fp32 (all but bf16 on a GPU).
    SWAP: the dot computes the transposed tile W x.T, so that the weight rows fill the tensor core's 64-row
    side and a few tokens its narrow side (BLOCK_M down to 16) instead of being padded to 64. M_BUCKET is the
    autotuner's key only."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.where(offs_n < N, offs_n, 0)  # clamped rows load real words; their sums are never stored
    m_ok = (offs_m < M)[:, None]
    DTYPE: tl.constexpr = tl.float32 if DOT_FP32 else x_ptr.dtype.element_ty
    PRECISION: tl.constexpr = "ieee" if DOT_FP32 else None
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    step0 = tl.program_id(1) * STEPS
    for step in range(step0, tl.minimum(step0 + STEPS, K // BLOCK_K)):
        k0 = tl.multiple_of(step * BLOCK_K, BLOCK_K)
        w = _weight_tile(w_ptr, meta_ptr, s_ptr, magic, rows, k0, stride_wn, stride_wk, stride_mn, stride_mk,
                         stride_sn, stride_sg, GROUP, QUANT, SPARSE, BLOCK_N, BLOCK_K, DEQUANT_FP32, DTYPE)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk, mask=m_ok, other=0.0)
        if SWAP:
            acc = tl.dot(w, tl.trans(x.to(DTYPE)), acc, input_precision=PRECISION)
        else:
            acc = tl.dot(x.to(DTYPE), tl.trans(w), acc, input_precision=PRECISION)
    o_ptr += tl.program_id(1) * stride_os
    if SWAP:
        tl.store(o_ptr + offs_n[:, None] * stride_on + offs_m[None, :] * stride_om, acc.to(o_ptr.dtype.element_ty),
                 mask=(offs_n[:, None] < N) & (offs_m[None, :] < M))
    else:
        tl.store(o_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on, acc.to(o_ptr.dtype.element_ty),
                 mask=m_ok & (offs_n[None, :] < N))


@triton.jit
def split_sum_kernel(p_ptr, y_ptr, SPLIT, MN, BLOCK: tl.constexpr):
    """y = the sum over splits of partials [SPLIT, M * N], in split order (the same result every run)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT):
        acc += tl.load(p_ptr + s * MN + offs, mask=ok, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


SUM_BLOCK = 1024
KMAX = {"bf16": 64, "w4": 64, "24w4": 64, "24": 64}
SMALL_KMAX = 128  # W4 and 2:4 + W4 in the swapped tile of up to 128 rows (the GPU's 64, the interpreter's 128)
KMIN = {"bf16": 16, "w4": 8, "24w4": 32, "24": 32}  # a dot's K; one packed word; one metadata word


def block_k(fmt: str, group: int, kmax: int | None = None, k: int | None = None) -> int:
    """The K block: the largest power of two <= kmax (default KMAX) that divides `group` (one scale per block;
    without scales pass K: no tail), or with `k` given, that is a whole number of groups dividing k (a scale
    per group in the block); 0 if none reaches KMIN."""
    bk = kmax or KMAX[fmt]
    while bk >= KMIN[fmt] and group % bk and not (k is not None and bk % group == 0 and k % bk == 0):
        bk //= 2
    return bk if bk >= KMIN[fmt] else 0


@functools.lru_cache(maxsize=1024)
def split(m: int, n: int, k: int, bm: int, bn: int, bk: int) -> tuple[int, int]:
    """(splits, K blocks per split): the split that gives the busiest SM the fewest K blocks to run (programs
    come in waves of SMS: 448 tiles of 64 K blocks run 4 x 64 = 256 a SM unsplit, 17 x 13 = 221 in five), the
    fewest splits among equals, none empty, and at most k / (32 m): the fp32 partial sums (8 m n bytes a
    split, written and read) stay within half of what a W4 weight streams (n k / 2 bytes)."""
    steps = k // bk
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)

    def busiest(s: int) -> tuple[int, int]:
        per = triton.cdiv(steps, s)
        return triton.cdiv(tiles * triton.cdiv(steps, per), SMS) * per, s

    _, best = min(busiest(s) for s in range(1, max(1, min(steps, k // (32 * m))) + 1))
    per = triton.cdiv(steps, best)
    return triton.cdiv(steps, per), per


def smem_bytes(fmt: str, bm: int, bn: int, bk: int, stages: int, x_bytes: int = 2) -> int:
    """Shared memory the pipeliner asks for, estimated: `stages` copies of the activation and stored-weight
    tiles plus one rebuilt bf16 weight tile (wgmma reads B from shared memory). kernels.inspect compares
    it with the compiler's number."""
    stored = {"bf16": bk * 2, "w4": bk // 2, "24": bk + bk // 8, "24w4": bk // 4 + bk // 8}[fmt] * bn
    return stages * (bm * bk * x_bytes + stored) + bn * bk * 2


def sum_splits(partials, y) -> None:
    """y = partials [SPLIT, M, N] summed over splits (fp32, fixed order)."""
    mn = y.numel()
    split_sum_kernel[(triton.cdiv(mn, SUM_BLOCK),)](partials, y, partials.shape[0], mn, BLOCK=SUM_BLOCK)


def tile_call(x, w, meta, scale, y, group: int, fmt: str, block: tuple[int, int], split_k: bool,
              dot_fp32: bool, swap: bool = False) -> tuple:
    """(grid, args, constexpr options, partials or None) of one tile launch for checked inputs; `fmt` is bf16,
    w4, 24 or 24w4, `block` (BLOCK_M, BLOCK_N); split_k: split K to fill the GPU, swap: the transposed dot
    (both for decode-sized M). kernels.inspect compiles exactly this."""
    (m, k), n = x.shape, y.shape[1]
    quant, sparse = fmt in ("w4", "24w4"), fmt in ("24", "24w4")
    bm, bn = block
    # the swapped tile's quantized formats take two groups a K step: half the loop's fixed cost per weight (the
    # 256-row tile has the weights per thread already, and would pass 100 KB of shared memory)
    two = quant and swap and bn <= 128
    bk = block_k(fmt, group, SMALL_KMAX, k) if two else block_k(fmt, group if quant else k)
    splits, steps = split(m, n, k, bm, bn, bk) if split_k else (1, k // bk)
    out = y if splits == 1 else y.new_empty((splits, m, n), dtype=torch.float32)
    o_strides = (0, y.stride(0), y.stride(1)) if splits == 1 else out.stride()
    if sparse and not quant and w.element_size() == 2 and (w.stride(1) != 1 or w.stride(0) % 2 or w.data_ptr() % 4):
        w = w.clone(memory_format=torch.contiguous_format)  # 16-bit 2:4 values are read as 32-bit pairs
    meta_t = meta if sparse else w  # unused pointers where the format has no such tensor
    s = scale if quant else w
    args = (x, w, meta_t, s, out, BF16_128X2, m, n, k, steps, *x.stride(), *w.stride(),
            *(meta_t.stride() if sparse else (0, 0)), *(s.stride() if quant else (0, 0)), *o_strides,
            min(triton.next_power_of_2(m), 4096))  # the M bucket: a prompt length does not retune
    opts = {"GROUP": group if quant else 1, "QUANT": quant, "SPARSE": sparse, "DOT_FP32": dot_fp32,
            "DEQUANT_FP32": dot_fp32 or x.dtype != torch.bfloat16, "SWAP": swap, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}
    grid = (triton.cdiv(n, bn), splits, triton.cdiv(m, bm))
    return grid, args, opts, None if splits == 1 else out
