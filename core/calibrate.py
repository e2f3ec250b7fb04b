"""Calibration engine: run calibration windows through the model one transformer block at a time,
collect statistics of each nn.Linear's inputs, and let a callback change the block before its outputs
become the next block's inputs.

SparseGPT, Wanda and OBS (prune/) and GPTQ (qat/) use it; head scoring (planned) will. Each of them needs, for
each linear, sums over its calibration inputs X [tokens, in]:
  H = XᵀX              the layer-wise Hessian proxy (||XWᵀ − XŴᵀ||² = tr(ΔW H ΔWᵀ))
  sq_norm_j = Σ x_j²   so Wanda's ||X_j||₂ = sqrt(sq_norm_j)

Memory: one block's inputs (n_windows × seq_len × dim), one batch's activations and one block's
statistics at a time; the whole model's activations are never held.

Precision: H and sq_norm are accumulated in float64 on CPU (fp64 matmul costs ~2x fp32 there, and
XᵀX of real activations spans many orders of magnitude, so the later Cholesky and the rank test for
"singular without dampening" need the extra digits); float32 on accelerators, where fp64 is slow.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass

import torch
from torch import nn
from tqdm import tqdm

from core.data import calibration_windows, corpus_record, is_corpus_mix, split_corpora
from core.device import release_memory
from core.errors import SmeltError
from core.text_source import CalibrationSourceConfig, source_record


@dataclass
class CalibConfig:
    n_windows: int = 128
    seq_len: int = 512
    seed: int = 0
    corpus: str = "wikitext2-valid"  # a '+'-joined mix (windows split evenly), a local path or hf:<dataset>
    batch_size: int = 8
    sequential: bool = True  # next block's inputs come from the modified block (SparseGPT, Wanda)

    def __post_init__(self):
        for name, lo in (("n_windows", 1), ("seq_len", 2), ("seed", 0), ("batch_size", 1)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise SmeltError(f"calibration {name}={v!r} must be an integer")
            if v < lo:
                why = ": no calibration data" if name == "n_windows" else ""
                raise SmeltError(f"calibration {name}={v} must be >= {lo}{why}")
        if is_corpus_mix(self.corpus):
            split_corpora(self.corpus, "calibration")
        else:
            CalibrationSourceConfig(source=self.corpus)  # a path or hub dataset: checked the same way
        if not isinstance(self.sequential, bool):
            raise SmeltError(f"calibration sequential={self.sequential!r} must be true or false")

    def windows(self, tokenizer) -> torch.Tensor:
        """[n_windows, seq_len] token windows (BOS first) from the configured corpus."""
        return calibration_windows(tokenizer, self.n_windows, self.seq_len, self.seed, self.corpus)

    def record(self) -> dict:
        """What a manifest records: these settings plus the corpus's source and text hash."""
        return {**asdict(self), "corpus_record": corpus_record(self.corpus) if is_corpus_mix(self.corpus)
                else source_record(CalibrationSourceConfig(source=self.corpus))}


class LinearStats:
    """Sums over calibration tokens of one linear's inputs x [in]: XᵀX, Σ x_j², token count.

    Linears fed the very same input tensor (wq/wk/wv, w1/w3) share one LinearStats object, so treat it
    as read-only (copy H before modifying it in place).
    """

    def __init__(self, in_features: int, dtype: torch.dtype = torch.float64,
                 device: torch.device | str = "cpu", hessian: bool = True):
        self.xtx = torch.zeros(in_features, in_features, dtype=dtype, device=device) if hessian else None
        self.sq_norm = torch.zeros(in_features, dtype=dtype, device=device)
        self.n_tokens = 0
        self._last: torch.Tensor | None = None  # the tensor added last: a shared input is added once

    @torch.no_grad()
    def add(self, x: torch.Tensor) -> None:
        if x is self._last:
            return
        self._last = x
        x = x.detach().reshape(-1, x.shape[-1]).to(self.sq_norm.dtype)
        if self.xtx is not None:
            self.xtx.addmm_(x.T, x)
        self.sq_norm.add_(x.square().sum(0))
        self.n_tokens += x.shape[0]

    def end_batch(self) -> None:
        self._last = None  # drop the reference: the batch's activations can be freed

    @property
    def H(self) -> torch.Tensor:
        if self.xtx is None:
            raise SmeltError("these statistics were collected without the Hessian (hessian=False)")
        return self.xtx

    @property
    def act_norm(self) -> torch.Tensor:
        """||X_j||₂ per input feature (Wanda's activation norm)."""
        return self.sq_norm.sqrt()


class _Collector:
    """Forward hooks on a block's selected linears, feeding a LinearStats per distinct input."""

    def __init__(self, linears: dict[str, nn.Linear], dtype: torch.dtype, hessian: bool):
        self.linears, self.dtype, self.hessian = linears, dtype, hessian
        self.stats: dict[str, LinearStats] = {}
        self.seconds = 0.0

    def _hook(self, name: str):
        def hook(module: nn.Linear, args, output):
            t0 = time.perf_counter()
            x = args[0]
            st = self.stats.get(name)
            if st is None:  # first batch: share the stats of a linear that already saw this tensor
                st = next((s for s in self.stats.values() if s._last is x), None) or LinearStats(
                    module.in_features, self.dtype, x.device, self.hessian)
                self.stats[name] = st
            st.add(x)
            self.seconds += time.perf_counter() - t0
        return hook

    @contextlib.contextmanager
    def attached(self):
        handles = [m.register_forward_hook(self._hook(n)) for n, m in self.linears.items()]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def end_batch(self) -> None:
        for st in self.stats.values():
            st.end_batch()


def _selector(targets: Callable[[str], bool] | Collection[str] | None) -> Callable[[str], bool]:
    if targets is None:
        return lambda name: True
    if callable(targets):
        return targets
    chosen = set(targets)
    return chosen.__contains__


OnBlock = Callable[[str, nn.Module, dict[str, LinearStats]], None]


@torch.no_grad()
def run_blocks(model: nn.Module, windows: torch.Tensor | None, on_block: OnBlock, cfg: CalibConfig,
               targets: Callable[[str], bool] | Collection[str] | None = None, hessian: bool = True,
               stats_dtype: torch.dtype | None = None, progress: bool = True) -> dict[str, float]:
    """Run `windows` [n, seq_len] through the model block by block, in layer order.

    For each block `layers.K`: a statistics pass runs the block on its inputs (in batches of
    cfg.batch_size) with hooks on the selected linears (`targets`: full module names such as
    "layers.3.feed_forward.w1", or a predicate; None = all); then `on_block("layers.K", block, stats)`
    may modify the block in place, stats being {full linear name: LinearStats}; then the next block's
    inputs are the block's outputs: recomputed with the modified block when cfg.sequential, else the
    statistics pass's (unmodified) outputs, with no extra forward. Blocks without a selected linear are
    still passed to on_block (with {}). Returns seconds spent: forward_s (block forwards, hooks
    excluded), stats_s (accumulating statistics), on_block_s.
    """
    if windows is None or windows.numel() == 0:
        raise SmeltError("no calibration data: run_blocks needs at least one window")
    if windows.ndim != 2:
        raise SmeltError(f"calibration windows must be [n, seq_len] token ids, got shape {tuple(windows.shape)}")
    seq_len = windows.shape[1]
    if seq_len > model.rope_cos.shape[0]:
        raise SmeltError(f"calibration seq_len={seq_len} exceeds the model's max_seq_len={model.rope_cos.shape[0]}")
    device = model.tok_embeddings.weight.device
    dtype = stats_dtype or (torch.float64 if device.type == "cpu" else torch.float32)
    selected = _selector(targets)
    cos, sin = model.rope_cos[:seq_len], model.rope_sin[:seq_len]
    seconds = {"forward_s": 0.0, "stats_s": 0.0, "on_block_s": 0.0}
    was_training, bar = model.training, None
    model.eval()
    try:
        # The current block's inputs, one tensor per batch; replaced in place by the block's outputs.
        hidden = [model.tok_embeddings(b.to(device)) for b in windows.split(cfg.batch_size)]
        bar = tqdm(total=len(model.layers), desc="calibrate", unit="block", disable=not progress)
        for key, block in model.layers.items():
            prefix = f"layers.{key}"
            linears = {f"{prefix}.{n}": m for n, m in block.named_modules()
                       if isinstance(m, nn.Linear) and selected(f"{prefix}.{n}")}
            collector = _Collector(linears, dtype, hessian)
            if linears or not cfg.sequential:
                t0 = time.perf_counter()
                with collector.attached():
                    for i, h in enumerate(hidden):
                        out = block(h, cos, sin)
                        collector.end_batch()
                        if not cfg.sequential:
                            hidden[i] = out
                        del out
                seconds["forward_s"] += time.perf_counter() - t0 - collector.seconds
                seconds["stats_s"] += collector.seconds
            t0 = time.perf_counter()
            on_block(prefix, block, collector.stats)
            seconds["on_block_s"] += time.perf_counter() - t0
            del collector  # free this block's statistics before the next block's
            if cfg.sequential:
                t0 = time.perf_counter()
                for i, h in enumerate(hidden):
                    hidden[i] = block(h, cos, sin)
                seconds["forward_s"] += time.perf_counter() - t0
            bar.update()
    finally:
        if bar is not None:
            bar.close()  # before any error is printed, so the message stays the last line
        model.train(was_training)
        hidden = None
        release_memory()
    return seconds
