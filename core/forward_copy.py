"""What the calibration passes run when the forward dtype is narrower than the block's (core.calibrate's
`forward`): a copy of the block with its linears in that dtype, kept in step with the block the algorithms
change."""
from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
from torch import nn


def forward_copy(block: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of `block` whose linears hold `dtype` weights; its other modules with weights (the norms) keep the
    block's dtype and hand their output on in `dtype`, so every linear gets `dtype` inputs while the residual
    stream (block input + branch outputs) stays in the block's dtype. Against a whole-bf16 copy: +2% time and
    half the error (SmolLM2 at 16 windows, the last hidden state 1.9% -> 0.9% from fp32's, KL 8.7e-4 -> 3.5e-4;
    experiments/probe_forward_copy.py): the residual stream is where bf16 rounding piles up."""
    # The linears' parameters enter the copy already in `dtype`: a plain deepcopy would hold the block's
    # weights twice in their own dtype first (8 bytes per parameter on the way, models.streamed counts 6).
    memo = {id(p): nn.Parameter(p.detach().to(dtype, copy=True), requires_grad=p.requires_grad)
            for m in block.modules() if isinstance(m, nn.Linear) for p in m.parameters(recurse=False)}
    fwd = copy.deepcopy(block, memo)
    for m in fwd.modules():
        if not isinstance(m, nn.Linear) and next(m.parameters(recurse=False), None) is not None:
            m.register_forward_hook(lambda module, args, out: out.to(dtype))
    return fwd


@torch.no_grad()
def refresh(fwd: nn.Module, block: nn.Module, names: Iterable[str] | None = None) -> None:
    """Copy `block`'s current weights into its forward copy `fwd` (the submodules `names`, or all of it)."""
    pairs = [(fwd, block)] if names is None else [(fwd.get_submodule(n), block.get_submodule(n)) for n in names]
    for f, b in pairs:
        for a, w in zip(f.parameters(), b.parameters(), strict=True):
            a.copy_(w)
