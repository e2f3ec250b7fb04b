"""The M = 1 kernels (kernels.decode) and the split-K tile (kernels.tile, 2 <= M <= 64) in Triton's interpreter
against the dequantize-then-fp32-matmul reference, through kernels.matmul's entry points."""
from __future__ import annotations

import pytest
import torch
from test_kernels import _close, _keep24, _on, _w4

from core.errors import SmeltError
from core.packing import pack_24, pack_int4
from kernels import decode, tile
from kernels.matmul import small_block, sparse24_matmul, sparse24_w4a16_matmul, w4a16_matmul

# N not a multiple of any BLOCK_N; K of several K blocks, so several split-K slices (and partial sums)
SHAPES = [(1, 37, 256, 64), (3, 37, 256, 64), (16, 21, 128, 32), (70, 21, 128, 64)]


def test_small_shapes_split_k_and_route_here():
    assert decode.plan("w4", 37, 256, 64)[3] == 4  # four K blocks of 64, one each: partials summed
    bn, _, _, splits, _ = decode.plan("w4", 14336, 4096, 64)
    assert -(-14336 // bn) * splits >= 2 * tile.SMS  # one token still fills the H100
    assert decode.supports("w4", 1, 64) and not decode.supports("w4", 2, 64)
    # the swapped tile: the tokens padded to 16, 32 or 64 only; splits fill the GPU at decode-sized M, and the
    # partial sums (8 M N bytes a split) stay within half of what the W4 weight streams (N K / 2 bytes)
    assert small_block(16) == (16, 64) and small_block(2) == (16, 64) and small_block(33) == (64, 64)
    assert tile.split(16, 28672, 4096, 16, 64, 64) == (5, 13)  # 448 tiles: 17 x 13 K blocks a SM, not 4 x 64
    splits, per = tile.split(16, 14336, 4096, 16, 64, 64)  # 224 tiles: no split runs fewer K blocks a SM
    assert -(-224 * splits // 132) * per == min(-(-224 * s // 132) * -(-64 // s) for s in range(1, 9))
    splits, _ = tile.split(16, 1024, 4096, 16, 64, 64)  # Llama-3.1-8B's k and v: 16 row blocks
    assert splits == 8 and 8 * 16 * 1024 * splits <= 1024 * 4096 / 2 / 2
    assert tile.split(2048, 14336, 4096, 64, 256, 64)[0] == 1
    assert tile.block_k("w4", 64) == 64 and tile.block_k("w4", 24) == 8 and tile.block_k("24w4", 16) == 0
    # the swapped tile: two groups a K step where K allows it (a scale per group in the block)
    assert tile.block_k("w4", 64, 128, 4096) == 128 and tile.block_k("w4", 64, 128, 576) == 64


@pytest.mark.parametrize("m,n,k,g", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w4_decode_matches_the_reference(m, n, k, g, dtype):
    gen = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=gen).to(dtype)
    q, scale, w = _w4(n, k, g, gen)
    _close(w4a16_matmul(*_on(x, pack_int4(q), scale), g), x.float() @ w.T, dtype)


@pytest.mark.parametrize("m,n,k,g", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_24w4_decode_matches_the_reference_on_random_masks(m, n, k, g, dtype):
    gen = torch.Generator().manual_seed(7 * m + n + k)
    x = torch.randn(m, k, generator=gen).to(dtype)
    q, scale, _ = _w4(n, k, g, gen)
    keep = _keep24(n, k, gen)
    keep[0, :4] = torch.tensor([False, False, True, False])  # a group keeping one: a zero slot at a free position
    q24 = q * keep
    kept, meta = pack_24(q24, keep)
    scale = scale.to(torch.bfloat16)  # as the release ships them
    w24 = q24.float() * scale.float().repeat_interleave(g, dim=1)
    _close(sparse24_w4a16_matmul(*_on(x, pack_int4(kept), meta, scale), g), x.float() @ w24.T, dtype)


@pytest.mark.parametrize("m", [1, 16])
def test_24_decode_matches_the_reference(m):
    gen = torch.Generator().manual_seed(m)
    n, k = 19, 256
    x = torch.randn(m, k, generator=gen)
    keep = _keep24(n, k, gen)
    dense = torch.randn(n, k, generator=gen) * keep
    values, meta = pack_24(dense, keep)
    _close(sparse24_matmul(*_on(x, values, meta)), x @ dense.T, torch.float32)


def test_decode_refuses_bad_input_like_the_tile_kernel():
    gen = torch.Generator().manual_seed(0)
    q, scale, _ = _w4(16, 128, 64, gen)
    with pytest.raises(SmeltError, match=r"scale must be float \[16, 2\]"):
        w4a16_matmul(torch.randn(1, 128), pack_int4(q), scale[:, :1], 64)
    keep = _keep24(16, 128, gen)
    kept, meta = pack_24(q * keep, keep)
    s16 = torch.rand(16, 8) + 0.05
    with pytest.raises(SmeltError, match="group_size 16: 24w4 kernels need a multiple of 32"):
        sparse24_w4a16_matmul(torch.randn(2, 128), pack_int4(kept), meta, s16, 16)


DISPATCH = """
import os, sys, torch
torch.cuda.is_available = lambda: {gpu}  # the device choice, mocked
import kernels.matmul as m
from core.errors import SmeltError
print(m.INTERPRET, m.DEVICE.type, os.environ.get("TRITON_INTERPRET"))
try:
    m.w4a16_matmul(torch.randn(2, 64), torch.zeros(8, 8, dtype=torch.int32), torch.ones(8, 1), 64)
except SmeltError as e:
    print("refused:", e)
"""


@pytest.mark.parametrize("gpu", [True, False])
def test_a_gpu_host_runs_the_compiled_kernels_on_its_tensors(gpu):
    """With a CUDA device the interpreter stays off and the kernels take GPU tensors only (the tests above put
    theirs on kernels.matmul.DEVICE); without one the interpreter runs on CPU tensors."""
    import os
    import subprocess
    import sys

    from conftest import ROOT

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", DISPATCH.format(gpu=gpu)], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=120, check=True).stdout.splitlines()
    if gpu:
        assert out[0] == "False cuda None"
        assert out[1] == "refused: the Triton kernels need a CUDA device or TRITON_INTERPRET=1"
    else:
        assert out == ["True cpu 1"]  # the CPU call ran in the interpreter
