"""The calibration passes' forward copy (core.forward_copy): linears in bf16, the residual stream in fp32."""
from __future__ import annotations

import copy

import torch
from conftest import tiny_config

from core.forward_copy import forward_copy, refresh
from models.llama import build_model


def test_the_bf16_forward_copy_keeps_the_residual_stream_fp32_and_halves_the_error():
    model = build_model(tiny_config(max_seq_len=64), seed=6).eval()
    block = model.layers["0"]
    x = torch.randn(2, 32, model.cfg.dim) * 3
    cos, sin = model.rope_cos[:32], model.rope_sin[:32]
    fwd = forward_copy(block, torch.bfloat16)
    assert {n: p.dtype for n, p in fwd.named_parameters() if p.dtype == torch.float32}.keys() == {
        "attention_norm.weight", "ffn_norm.weight"}  # the linears run in bf16; the norms stay fp32
    seen = {}
    for n, m in fwd.named_modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_pre_hook(lambda mod, args, n=n: seen.__setitem__(n, args[0].dtype))
    with torch.no_grad():
        ref, mixed = block(x, cos, sin), fwd(x, cos, sin)
        whole = copy.deepcopy(block).to(torch.bfloat16)(x.bfloat16(), cos, sin)
    assert mixed.dtype == torch.float32 and set(seen.values()) == {torch.bfloat16} and len(seen) == 7
    assert all(p.dtype == torch.float32 for p in block.parameters())  # the block itself is untouched
    ptrs = {p.data_ptr() for p in block.parameters()}
    assert not ptrs & {p.data_ptr() for p in fwd.parameters()}  # a copy: nothing shared with the block
    for (n, a), b in zip(fwd.named_parameters(), block.parameters(), strict=True):
        assert torch.equal(a, b.to(a.dtype)), n  # the block's values, rounded once
    def err(y):
        return float((y.float() - ref).norm() / ref.norm())
    assert err(mixed) < err(whole) / 2  # the residual stream is where bf16 rounding piles up


def test_refresh_copies_the_changed_weights_of_the_named_submodules_only():
    model = build_model(tiny_config(max_seq_len=64), seed=6).eval()
    block = model.layers["0"]
    fwd = forward_copy(block, torch.bfloat16)
    with torch.no_grad():
        block.attention.wq.weight.mul_(2)
        block.feed_forward.w2.weight.mul_(3)
    refresh(fwd, block, ["attention.wq"])
    assert torch.equal(fwd.attention.wq.weight, block.attention.wq.weight.bfloat16())
    assert not torch.equal(fwd.feed_forward.w2.weight, block.feed_forward.w2.weight.bfloat16())
    refresh(fwd, block)
    assert torch.equal(fwd.feed_forward.w2.weight, block.feed_forward.w2.weight.bfloat16())
