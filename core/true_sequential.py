"""True-sequential calibration of one block in a single forward pass (core.calibrate's `true_sequential`).

The block-at-a-time engine runs each block twice: a statistics pass on the unchanged block (to the input of its
last linear), then an output pass on the changed block. GPTQ's `--true-sequential` order instead calibrates the
block's linears group by group (q/k/v, then o, then gate/up, then down), each on inputs computed through the
groups already changed. That order needs each linear's output once, after its change, so one forward pass is
enough, provided every batch can stop at a group's input until all batches have reached it and the group has
been changed. The block stays a black box here (any nn.Module, streamed or not): each batch's forward runs in its
own thread and a forward pre-hook parks it there. Threads hand a baton: exactly one of them (or the engine) runs
at any time, so torch's intra-op threads are never shared and the results are deterministic. The price is
memory: every batch's activations up to the parked linear live at once (about 2.1 × dim + hidden floats per
token at the down projection of a Llama block).
"""
from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from torch import nn


class _Abort(BaseException):
    """Raised in a parked batch's thread when the engine gives up (an error elsewhere): unwinds it quietly."""


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
    state = {"stage": 0, "abort": False}  # stage: index of the group being collected
    go = [threading.Semaphore(0) for _ in hidden]
    back = threading.Semaphore(0)
    local = threading.local()
    outputs: list[torch.Tensor | None] = [None] * len(hidden)
    errors: list[BaseException | None] = [None] * len(hidden)
    finished = [False] * len(hidden)

    def park(name: str):
        def hook(module, args):
            if first.get(name) != state["stage"] or not hasattr(local, "index"):
                return  # a group already changed (or a linear sharing its input): run through
            collect(name, args[0])
            back.release()
            go[local.index].acquire()
            if state["abort"]:
                raise _Abort
        return hook

    def batch(i: int) -> None:
        local.index = i
        go[i].acquire()
        try:
            if not state["abort"]:
                with torch.no_grad():
                    outputs[i] = fwd(hidden[i], cos, sin)
        except BaseException as e:  # noqa: BLE001 - handed to the engine's thread
            errors[i] = e
        finally:
            del local.index
            finished[i] = True
            back.release()

    def advance() -> None:
        """Let each unfinished batch run to its next stop, one at a time."""
        for i in (i for i, f in enumerate(finished) if not f):
            go[i].release()
            back.acquire()
            if errors[i] is not None and not isinstance(errors[i], _Abort):
                raise errors[i]

    handles = [modules[g[0]].register_forward_pre_hook(park(g[0])) for g in groups]
    threads = [threading.Thread(target=batch, args=(i,), daemon=True, name=f"calibrate-batch-{i}")
               for i in range(len(hidden))]
    for t in threads:
        t.start()
    try:
        for stage, group in enumerate(groups):
            state["stage"] = stage
            advance()
            change(group)
        state["stage"] = len(groups)
        advance()
        for i, out in enumerate(outputs):
            hidden[i] = out
    finally:
        state["abort"] = True
        for i in (i for i, f in enumerate(finished) if not f):  # parked or not started: wake it to unwind
            go[i].release()
            back.acquire()
        for t in threads:
            t.join()
        for handle in handles:
            handle.remove()
