"""True-sequential calibration of one block in a single forward pass (core.calibrate's `true_sequential`).

The block-at-a-time engine runs each block twice: a statistics pass on the unchanged block (to the input of its
last linear), then an output pass on the changed block. GPTQ's `--true-sequential` order instead calibrates the
block's linears group by group (q/k/v, then o, then gate/up, then down), each on inputs computed through the
groups already changed. That order needs each linear's output once, after its change, so one forward pass is
enough, provided every batch can stop at a group's input until all batches have reached it and the group has
been changed. The block stays a black box here (any nn.Module, streamed or not): each batch's forward runs in its
own greenlet and a forward pre-hook switches back to the engine there. Greenlets, not threads: one OS thread
keeps one OpenMP team (a parked thread per batch made the main thread's small parallel regions, the OBS
sweeps, up to 2.7x slower on 2 cores). The price is memory: every batch's activations up to the parked linear
live at once (models.streamed.footprint counts them).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from greenlet import getcurrent, greenlet
from torch import nn

from core.device import synchronize
from core.forward_copy import refresh

if TYPE_CHECKING:  # core.calibrate imports this module
    from core.calibrate import OnBlock, _Collector


def linear_groups(block: nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  selected: Callable[[str], bool]) -> list[list[str]]:
    """The selected linears of `block` (names relative to it) in the order they run on `h`, grouped by the
    very input tensor they share (wq/wk/wv, w1/w3)."""
    names = {m: n for n, m in block.named_modules() if isinstance(m, nn.Linear) and selected(n)}
    groups: list[list[str]] = []
    last: list[torch.Tensor | None] = [None]

    def record(module, args):
        if args[0] is last[0]:
            groups[-1].append(names[module])
        else:
            groups.append([names[module]])
        last[0] = args[0]
    handles = [m.register_forward_pre_hook(record) for m in names]
    try:
        with torch.no_grad():
            block(h, cos, sin)
    finally:
        for handle in handles:
            handle.remove()
    return groups


def run_block(fwd: nn.Module, hidden: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
              groups: list[list[str]], collect: Callable[[str, torch.Tensor], None],
              change: Callable[[list[str]], None]) -> None:
    """Run every batch of `hidden` through `fwd` once, in place (hidden[i] becomes its output), stopping all of
    them at each group's first linear: `collect(name, x)` sees every batch's input there, then `change(group)`
    modifies the group (and `fwd`'s copy of it) before any batch computes its output."""
    modules = dict(fwd.named_modules())
    first = {g[0]: k for k, g in enumerate(groups)}
    stage = [0]  # the group being collected
    engine = getcurrent()

    def park(name: str):
        def hook(module, args):
            if first[name] == stage[0] and getcurrent() is not engine:  # else: already changed, run through
                collect(name, args[0])
                engine.switch()
        return hook

    def batch(i: int) -> torch.Tensor:
        with torch.no_grad():
            return fwd(hidden[i], cos, sin)

    handles = [modules[g[0]].register_forward_pre_hook(park(g[0])) for g in groups]
    batches = [greenlet(lambda i=i: batch(i)) for i in range(len(hidden))]
    try:
        for stage[0] in range(len(groups) + 1):  # the last round runs every batch to its output
            for i, g in enumerate(batches):
                if g.dead:  # finished in an earlier round (it reached no further group)
                    continue
                out = g.switch()  # errors raised in a batch come out here
                if g.dead:
                    hidden[i] = out
            if stage[0] < len(groups):
                change(groups[stage[0]])
    finally:
        for g in batches:
            if not g.dead:
                g.throw()  # GreenletExit at its parked hook: the forward unwinds, its activations are freed
        for handle in handles:
            handle.remove()


def calibrate_block(prefix: str, block: nn.Module, fwd: nn.Module, hidden: list[torch.Tensor], cos: torch.Tensor,
                    sin: torch.Tensor, collector: _Collector, on_block: OnBlock, seconds: dict[str, float]) -> None:
    """One block of core.calibrate.run_blocks, true-sequential: each group's statistics, on_block on them, the
    group's new weights into `fwd`, one forward pass in all; `hidden` becomes the changed block's outputs."""
    t0, changing = time.perf_counter(), 0.0
    full = {n.removeprefix(prefix + "."): n for n in collector.linears}
    # One window finds the order the linears run in and which share an input.
    groups = linear_groups(fwd, hidden[0][:1], cos, sin, full.__contains__)

    def change(group: list[str]) -> None:
        nonlocal changing
        synchronize()  # the forward's queued kernels are forward time (GPU)
        t1 = time.perf_counter()
        shared = collector.stats[full[group[0]]]
        shared.end_batch()
        on_block(prefix, block, {full[n]: shared for n in group})
        if fwd is not block:  # the changed weights, in the forward dtype
            refresh(fwd, block, group)
        synchronize()
        changing += time.perf_counter() - t1

    run_block(fwd, hidden, cos, sin, groups, lambda n, x: collector.add(full[n], x), change)
    synchronize()
    seconds["on_block_s"] += changing
    seconds["stats_s"] += collector.seconds
    seconds["forward_s"] += time.perf_counter() - t0 - changing - collector.seconds
