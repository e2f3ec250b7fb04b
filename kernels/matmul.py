"""Triton matmuls for the release's weights: y = x @ W.T with W stored as

- W4A16:     int4 codes packed 8 per int32 word along the input dim + per-group symmetric scales
             (compressed-tensors pack-quantized, read in place: no repacking);
- 2:4:       the kept half of each row + 4 bits of position metadata per group of 4 (core.packing);
- 2:4 + W4:  the kept half as int4 codes (packed the same way) + the metadata + the W4 scales.

Which kernel runs depends on M (tokens in the call):

- M = 1: kernels.decode, split-K matrix-vector products over the stored words (fp32 multiply-add);
- 2 <= M <= SMALL_M: kernels.tile with the swapped dot (64 weight rows x the tokens padded to 16, 32 or 64)
  and split-K, so that decode-sized batches fill the GPU without padded multiply-adds;
- larger M: kernels.tile, autotuned among LARGE_CONFIGS once per (M bucket, N, K, format), the configs whose
  shared memory would not fit pruned before any launch.

On a machine without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set by the kernels
package when no CUDA device exists) with dots in fp32: the interpreter's low-precision `tl.dot` is not trustworthy.
"""
from __future__ import annotations

import os

import torch
import triton

from core.errors import SmeltError
from core.packing import INT4_PER_WORD, META_INPUTS
from kernels import decode, tile

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = torch.device("cpu" if INTERPRET else "cuda")  # where the kernels' inputs must live
ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FORMAT = {(False, False): "bf16", (True, False): "w4", (False, True): "24", (True, True): "24w4"}  # (quant, sparse)


SMALL_M = tile.SMALL_M
SMALL_N = 64  # weight rows a program owns for 2 <= M <= SMALL_M: one wgmma row block; small tiles fill the GPU
WIDE_N = 256  # 2:4 + W4 on N >= WIDE_MIN_N: its rebuild costs fewer instructions a weight in a wider tile
WIDE_MIN_N = 4096
SMALL_OPTIONS = {"num_warps": 4, "num_stages": 3}


def small_block(m: int, n: int = 0, fmt: str = "w4") -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) of the swapped tile at M tokens and N outputs: M padded to 16, 32 or 64 (the narrow
    side of the dot), 64 weight rows, or 256 for 2:4 + W4 where N still gives enough row blocks."""
    return max(16, triton.next_power_of_2(m)), WIDE_N if fmt == "24w4" and n >= WIDE_MIN_N else SMALL_N


# (BLOCK_M, BLOCK_N, warps, stages, formats) for M > SMALL_M, each within 100 KB of shared memory; BLOCK_K
# follows the format and group (kernels.tile). The 2:4 formats get a 128 x 128 tile: their longer rebuild
# needs twice the multiply-adds per rebuilt weight to stay tensor-bound, and 128 columns keep the grid full
# on narrow layers (k, v)
ALL = ("bf16", "w4", "24", "24w4")
LARGE_CONFIGS = [(64, 256, 4, 3, ALL), (64, 256, 4, 4, ("w4", "24w4")), (128, 128, 8, 3, ("24", "24w4"))]
SMEM_LIMIT = 227 * 1024  # H100: the most shared memory one block may ask for
INTERPRET_BLOCK = (64, 128)  # the interpreter's cost is per program: big tiles, few programs


_LARGE = [(triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st), fmts)
          for bm, bn, w, st, fmts in LARGE_CONFIGS]


def _fits(configs, named_args, **kwargs):
    """early_config_prune: this format's configs whose estimated shared memory fits one block."""
    fmt = FORMAT[bool(kwargs["QUANT"]), bool(kwargs["SPARSE"])]
    allowed = {id(c) for c, fmts in _LARGE if fmt in fmts}
    kept = [c for c in configs if id(c) in allowed and tile.smem_bytes(
        fmt, c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], kwargs["BLOCK_K"], c.num_stages,
        named_args["x_ptr"].element_size()) <= SMEM_LIMIT]
    return kept or [c for c, _ in _LARGE[:1]]


_large = triton.autotune(
    [c for c, _ in _LARGE], key=["M_BUCKET", "N", "K", "QUANT", "SPARSE", "GROUP"],
    prune_configs_by={"early_config_prune": _fits},
)(tile.tile_kernel)


def _check(cond: bool, msg) -> None:
    """Raise msg() when cond fails: the message is built only then, not on every call."""
    if not cond:
        raise SmeltError(msg())


def check_inputs(x: torch.Tensor, w: torch.Tensor, meta: torch.Tensor | None, scale: torch.Tensor | None,
                 out_features: int, group_size: int, quant: bool, sparse: bool) -> None:
    """Every shape, dtype and device of one matmul's inputs, one SmeltError line before any launch (messages are
    lambdas: a passing call builds no strings)."""
    _check(x.ndim == 2 and x.dtype in ACT_DTYPES, lambda: f"x must be 2-D float16/bfloat16/float32, got {x.dtype} "
           f"{list(x.shape)}")
    K = x.shape[1]
    devices = {t.device for t in (x, w, meta, scale) if t is not None}
    _check(len(devices) == 1, lambda: f"kernel inputs on several devices: {sorted(map(str, devices))}")
    _check(x.is_cuda or INTERPRET, lambda: "the Triton kernels need a CUDA device or TRITON_INTERPRET=1")
    if not x.is_cuda:  # the interpreter runs on host memory only
        _check(x.device.type == "cpu", lambda: f"interpreter inputs must be on the CPU, got {x.device}")
    stored = K // 2 if sparse else K  # inputs of a row actually stored
    if quant:
        _check(w.dtype == torch.int32 and tuple(w.shape) == (out_features, stored // INT4_PER_WORD),
               lambda: f"packed weight must be int32 [{out_features}, {stored // INT4_PER_WORD}] for x "
               f"{list(x.shape)}, got {w.dtype} {list(w.shape)}")
        _check(group_size > 0 and K % group_size == 0, lambda: f"group_size {group_size} must divide in_features {K}")
        _check(scale is not None and scale.is_floating_point()
               and tuple(scale.shape) == (out_features, K // group_size),
               lambda: f"scale must be float [{out_features}, {K // group_size}] (group_size {group_size}), got "
               f"{None if scale is None else (scale.dtype, list(scale.shape))}")
        _check(stored % INT4_PER_WORD == 0, lambda: f"in_features {K} does not fill whole int4 words")
    else:
        _check(w.is_floating_point() and tuple(w.shape) == (out_features, stored),
               lambda: f"weight values must be float [{out_features}, {stored}], got {w.dtype} {list(w.shape)}")
    if sparse:
        _check(K % META_INPUTS == 0, lambda: f"2:4 needs in_features a multiple of {META_INPUTS}, got {K}")
        _check(meta is not None and meta.dtype == torch.int32
               and tuple(meta.shape) == (out_features, K // META_INPUTS),
               lambda: f"2:4 meta must be int32 [{out_features}, {K // META_INPUTS}], got "
               f"{None if meta is None else (meta.dtype, list(meta.shape))}")
    fmt = FORMAT[quant, sparse]
    _check(tile.block_k(fmt, group_size if quant else K) > 0,
           lambda: f"group_size {group_size}: {fmt} kernels need a multiple of {tile.KMIN[fmt]}" if quant else
           f"in_features {K}: {fmt} kernels need a multiple of {tile.KMIN[fmt]}")


def _launch(x: torch.Tensor, w: torch.Tensor, meta: torch.Tensor | None, scale: torch.Tensor | None,
            out_features: int, group_size: int, quant: bool, sparse: bool) -> torch.Tensor:
    check_inputs(x, w, meta, scale, out_features, group_size, quant, sparse)
    M = x.shape[0]
    y = torch.empty(M, out_features, dtype=x.dtype, device=x.device)
    if M == 0 or out_features == 0:
        return y
    fmt = FORMAT[quant, sparse]
    if M == 1:
        return decode.decode_launch(x, w, meta, scale, y, group_size, fmt)
    dot_fp32 = INTERPRET or x.dtype == torch.float32
    if INTERPRET or M <= SMALL_M:
        swap = M <= SMALL_M
        bm, bn = small_block(M, out_features, fmt) if swap else INTERPRET_BLOCK
        if INTERPRET:  # the interpreter's cost is per program: as few as the tile allows
            bn = INTERPRET_BLOCK[1]
        grid, args, opts, partials = tile.tile_call(x, w, meta, scale, y, group_size, fmt, (bm, bn), True, dot_fp32,
                                                    swap)
        tile.tile_kernel[grid](*args, **opts, **({} if INTERPRET else SMALL_OPTIONS))
        if partials is not None:
            tile.sum_splits(partials, y)
        return y
    _, args, opts, _ = tile.tile_call(x, w, meta, scale, y, group_size, fmt, (1, 1), False, dot_fp32)
    for name in ("BLOCK_M", "BLOCK_N"):
        del opts[name]
    grid = lambda c: (triton.cdiv(out_features, c["BLOCK_N"]), 1, triton.cdiv(M, c["BLOCK_M"]))
    _large[grid](*args, **opts)
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
