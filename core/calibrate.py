"""Calibration engine: run calibration windows through the model one transformer block at a time,
collect statistics of each nn.Linear's inputs, and let a callback change the block before its outputs
become the next block's inputs.

SparseGPT, Wanda and OBS (prune/) and GPTQ (qat/) use it; head scoring (planned) will. Each of them needs, for
each linear, sums over its calibration inputs X [tokens, in]:
  H = XᵀX              the layer-wise Hessian proxy (||XWᵀ − XŴᵀ||² = tr(ΔW H ΔWᵀ))
  sq_norm_j = Σ x_j²   so Wanda's ||X_j||₂ = sqrt(sq_norm_j)
and, with teacher targets (sequential calibration only), the teacher's input to the same linear at the same
token, x_d, from a second stream of activations that runs the blocks as they were before any change:
  C = X_dᵀX            so ||X_d Wᵀ − X Ŵᵀ||² = const − 2 tr(Ŵ (W C)ᵀ) + tr(Ŵ H Ŵᵀ): the layer matched to
                       the teacher's own output there, which also undoes what earlier blocks' changes did to X

Memory: one block's inputs (n_windows × seq_len × dim), one batch's activations and one block's
statistics at a time; the whole model's activations are never held. `true_sequential` (one forward pass per
block instead of two, core.true_sequential) holds every batch's activations inside the block at once.

Precision (CalibConfig, measured in docs/performance.md's time/quality table):
- `hessian`: "float64" forms every batch's XᵀX in fp64 (the reference; fp64 matmul costs ~2.5x fp32 on
  CPU); "float32" forms each batch's XᵀX with an fp32 matmul and sums the batches in fp64, so rounding does
  not grow with the token count; H is then handed out as fp32, so the rank test for "singular without
  dampening" (core.obs) judges it by fp32's epsilon, the precision its products had. "bfloat16" forms the
  per-batch products in bf16 (avx512-bf16 / AMX on CPU; each batch's entries rounded to 8 bits, the rounding
  averaging out over batches in the fp64 sum) and hands H out in fp32: rounding the sum itself to bf16 cost
  GPTQ +17-20% KL (docs/performance.md). Its rounding lies far above fp32's epsilon, where the rank test could not see
  a singular H, so dampening (percdamp > 0) is required (CalibConfig.check_dampening). "auto" is bf16 where
  the hardware has bf16 matmul units, else fp32 (a CPU without them would emulate bf16, slower than fp32).
- `forward`: the dtype of the block forward passes' matmuls. "bfloat16" runs a copy of each block whose
  linears hold bf16 weights (AMX / avx512-bf16 on CPU, tensor cores on GPU) while the residual stream and the
  norms stay fp32 (core.forward_copy); the statistics still come out in the wide type above, and the algorithms
  still modify the fp32 block. "auto" is bf16 where the hardware has it, else fp32.
"""
from __future__ import annotations

import contextlib
import functools
import sys
import time
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass
from typing import Protocol

import torch
from torch import nn
from tqdm import tqdm

from core import true_sequential
from core.data import WINDOW_SAMPLING, calibration_windows, corpus_record, is_corpus_mix, split_corpora
from core.device import bf16_is_fast, release_memory, synchronize
from core.errors import SmeltError
from core.forward_copy import forward_copy, refresh
from core.linear_stats import LinearStats
from core.text_source import CalibrationSourceConfig, source_record


@dataclass
class CalibConfig:
    n_windows: int = 128
    seq_len: int = 512
    seed: int = 0
    corpus: str = "wikitext2-valid"  # a '+'-joined mix (windows split evenly), a local path or hf:<dataset>
    # a mix's windows: "disjoint" (no token twice) or "overlapping" (independent offsets: the CLIs' default, the
    # sampling their recorded measurements used; a recipe that does not say asks for disjoint)
    sampling: str = "overlapping"
    batch_size: int = 8
    sequential: bool = True  # next block's inputs come from the modified block (SparseGPT, Wanda)
    forward: str = "float32"  # block forward dtype: float32, bfloat16, or auto (bf16 where the hardware has it)
    # XᵀX per batch in float64, float32 or bfloat16, summed over batches in float64. float32: 1.4x faster
    # SparseGPT / GPTQ at KL within the noise of any numerics change (docs/performance.md).
    hessian: str = "float32"  # or auto: bf16 products where the hardware has bf16 units, else float32
    # Each group of linears sharing an input (q/k/v, o, gate/up, down) calibrated on inputs through the groups
    # of its block already changed (GPTQ's --true-sequential order), in one forward pass per block instead of
    # a statistics pass and an output pass (core.true_sequential); more activations live at once.
    true_sequential: bool = False

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
        if self.sampling not in WINDOW_SAMPLING:
            raise SmeltError(f"calibration sampling={self.sampling!r} is not one of {', '.join(WINDOW_SAMPLING)}")
        if not isinstance(self.sequential, bool):
            raise SmeltError(f"calibration sequential={self.sequential!r} must be true or false")
        if not isinstance(self.true_sequential, bool):
            raise SmeltError(f"calibration true_sequential={self.true_sequential!r} must be true or false")
        if self.true_sequential and not self.sequential:
            raise SmeltError("calibration true_sequential=true needs sequential=true (inputs through the changed "
                             "linears)")
        if self.forward not in FORWARD_DTYPES:
            raise SmeltError(f"calibration forward={self.forward!r} is not one of {', '.join(FORWARD_DTYPES)}")
        if self.hessian not in HESSIAN_DTYPES:
            raise SmeltError(f"calibration hessian={self.hessian!r} is not one of {', '.join(HESSIAN_DTYPES)}")

    def check_dampening(self, percdamp: float, device: torch.device) -> None:
        """A Hessian method's dampening against these statistics on `device`: bf16 products need percdamp > 0."""
        if self.hessian_dtype(device) == torch.bfloat16 and percdamp == 0:
            raise SmeltError(f"calibration hessian={self.hessian} needs percdamp > 0: its bf16 products' rounding "
                             "would hide a singular Hessian from the rank test")

    def hessian_dtype(self, device: torch.device) -> torch.dtype:
        """Each batch's XᵀX product dtype on `device` ("auto" resolved: bf16 where it runs fast, else fp32)."""
        if self.hessian == "auto":
            return torch.bfloat16 if bf16_is_fast(device) else torch.float32
        return getattr(torch, self.hessian)

    def forward_dtype(self, device: torch.device) -> torch.dtype:
        """The block forward dtype on `device` ("auto" resolved; bf16 refused where it cannot run fast)."""
        if self.forward == "float32":
            return torch.float32
        fast = bf16_is_fast(device)
        if self.forward == "auto":
            return torch.bfloat16 if fast else torch.float32
        if not fast:
            raise SmeltError(f"calibration forward=bfloat16: {device.type} has no bf16 matmul units "
                             "(AMX / avx512-bf16 or a CUDA GPU); use float32 or auto")
        return torch.bfloat16

    def windows(self, tokenizer) -> torch.Tensor:
        """[n_windows, seq_len] token windows (BOS first) from the configured corpus; errors name the CLI flags."""
        return calibration_windows(tokenizer, self.n_windows, self.seq_len, self.seed, self.corpus, self.sampling,
                                   ("--calib-windows", "--calib-seq-len"))

    def record(self, device: torch.device | str = "cpu") -> dict:
        """What a manifest records: these settings (the forward dtype resolved on `device`) plus the corpus's
        source and text hash."""
        device = torch.device(device)
        return {**asdict(self), "forward_dtype": str(self.forward_dtype(device)).removeprefix("torch."),
                "hessian_dtype": str(self.hessian_dtype(device)).removeprefix("torch."),
                "corpus_record": corpus_record(self.corpus) if is_corpus_mix(self.corpus)
                else source_record(CalibrationSourceConfig(source=self.corpus))}


FORWARD_DTYPES = ("float32", "bfloat16", "auto")
# What a refit of the kept weights matches (prune.run --refit): the layer's own output on the model's inputs, or
# the teacher's output there (run_blocks' teacher_targets)
REFIT_TARGETS = ("layer", "teacher")
# prune.reconstruct --inputs: an MLP fitted on the teacher's stream, on the pruned model's own, or on its own with
# the block's output as the target; --fit: the MLP's linears trained, or every linear of the block (the first of
# each is prune.reconstruct's default; the recipe checks them before anything runs)
RECONSTRUCT_INPUTS = ("teacher", "student", "block")
RECONSTRUCT_FITS = ("mlp", "block")
HESSIAN_DTYPES = ("float64", "float32", "bfloat16", "auto")
# prune.heads' calibration by default (its flags' defaults; the recipe's plan counts a heads stage's windows with it)
HEADS_CALIB = CalibConfig(n_windows=32, seq_len=512, corpus="wikitext2-valid")


def check_reconstruct(inputs: str, fit: str, prefix: str) -> None:
    """A one-line SmeltError for prune.reconstruct's --inputs / --fit values (prefix: "--", or a recipe stage's
    "stages[i].")."""
    for name, value, allowed in (("inputs", inputs, RECONSTRUCT_INPUTS), ("fit", fit, RECONSTRUCT_FITS)):
        if value not in allowed:
            raise SmeltError(f"{prefix}{name}={value!r} must be one of {', '.join(allowed)}")
    if fit == "block" and inputs == "student":  # the block's output is the target: that is inputs "block"
        raise SmeltError(f"{prefix}fit='block' fits the block's output: {prefix}inputs must be teacher or block, "
                         f"not student")


def add_precision_args(ap) -> None:
    """--calib-forward and --calib-hessian (CalibConfig.forward / .hessian) on a stage's argument parser."""
    ap.add_argument("--calib-forward", default=CalibConfig.forward, choices=FORWARD_DTYPES,
                    help="block forward dtype (auto: bf16 where AMX/avx512-bf16 or a GPU has it)")
    ap.add_argument("--calib-hessian", default=CalibConfig.hessian, choices=HESSIAN_DTYPES,
                    help="XᵀX per batch in float64, float32 or bfloat16 (auto: bf16 where the hardware has it, else "
                         "float32), the batches summed in float64")


def add_sampling_arg(ap) -> None:
    """--calib-sampling (CalibConfig.sampling) on a stage's argument parser."""
    ap.add_argument("--calib-sampling", default=CalibConfig.sampling, choices=WINDOW_SAMPLING,
                    help="how a corpus mix's windows are drawn: disjoint (no token in two windows) or overlapping "
                         "(independent seeded offsets)")


def calibration_device(model: nn.Module, stream=None) -> torch.device:
    """Where calibration runs: a streamed model's device (its weights wait on meta), else the model's own."""
    return stream.device if stream is not None else model.tok_embeddings.weight.device


class _Collector:
    """Forward pre-hooks on a block's selected linears, feeding a LinearStats per distinct input (inputs
    only: a pass may stop before a linear's output is computed)."""

    def __init__(self, linears: dict[str, nn.Linear], hessian: bool, product_dtype: torch.dtype):
        self.linears, self.hessian, self.product_dtype = linears, hessian, product_dtype
        self.stats: dict[str, LinearStats] = {}
        self.seconds = 0.0
        self.teacher_inputs: dict[str, torch.Tensor] | None = None  # this batch's, set by capture_teacher
        self.capturing = False  # a teacher-stream forward: no statistics, no stop

    def add(self, name: str, x: torch.Tensor) -> None:
        """One batch of `name`'s inputs."""
        synchronize()  # on a GPU the forward's queued kernels are the forward's time, not the statistics'
        t0 = time.perf_counter()
        st = self.stats.get(name)
        if st is None:  # first batch: share the stats of a linear that already saw this tensor
            st = next((s for s in self.stats.values() if s._last is x), None) or LinearStats(
                self.linears[name].in_features, torch.float64, x.device, self.hessian, self.product_dtype)
            self.stats[name] = st  # fp64 sums
        st.add(x, None if self.teacher_inputs is None else self.teacher_inputs[name])
        synchronize()
        self.seconds += time.perf_counter() - t0

    def _hook(self, name: str):
        def hook(module: nn.Linear, args):
            if not self.capturing:
                self.add(name, args[0])
        return hook

    @contextlib.contextmanager
    def capture_teacher(self):
        """While attached, record each selected linear's input (the teacher stream's batch) for C."""
        captured: dict[str, torch.Tensor] = {}

        def keep(name):
            return lambda module, args: captured.__setitem__(name, args[0])
        handles = [m.register_forward_pre_hook(keep(n)) for n, m in self.linears.items()]
        self.capturing = True
        try:
            yield
        finally:
            self.capturing = False
            for h in handles:
                h.remove()
        self.teacher_inputs = captured

    @contextlib.contextmanager
    def attached(self):
        handles = [m.register_forward_pre_hook(self._hook(n)) for n, m in self.linears.items()]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def end_batch(self) -> None:
        for st in self.stats.values():
            st.end_batch()
        self.teacher_inputs = None


def _selector(targets: Callable[[str], bool] | Collection[str] | None) -> Callable[[str], bool]:
    if targets is None:
        return lambda name: True
    if callable(targets):
        return targets
    chosen = set(targets)
    return chosen.__contains__


OnBlock = Callable[[str, nn.Module, dict[str, LinearStats]], None]


def shared_inputs(stats: dict[str, LinearStats]) -> list[list[str]]:
    """The linears grouped by shared statistics (wq/wk/wv, w1/w3: one input tensor), in order: a row-wise
    algorithm (GPTQ, N:M SparseGPT) can run one sweep over the group's stacked rows with one H inverse."""
    groups: dict[int, list[str]] = {}
    for name, st in stats.items():
        groups.setdefault(id(st), []).append(name)
    return list(groups.values())


class BlockStream(Protocol):
    """Where a streamed model's modules come from and go to (models.streamed.StreamedModel)."""

    device: torch.device

    def load(self, name: str, module: nn.Module) -> None: ...

    def release(self, name: str, module: nn.Module) -> None: ...


class _StopPass(Exception):
    """Raised at the block's last Linear in a sequential statistics pass: what follows is never used."""


def _stop_unless_capturing(collector: _Collector, module, args):
    if not collector.capturing:  # a teacher-stream forward runs the whole block: its output is the next input
        raise _StopPass


def _last_linear(block: nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 hooks: _Collector) -> tuple[nn.Linear | None, torch.Tensor]:
    """Run one batch through the block recording the order its Linears execute in; (the last, output)."""
    order: list[nn.Linear] = []
    handles = [m.register_forward_pre_hook(lambda mod, args: order.append(mod))
               for m in block.modules() if isinstance(m, nn.Linear)]
    try:
        with hooks.attached():
            out = block(h, cos, sin)
    finally:
        for handle in handles:
            handle.remove()
    return (order[-1] if order else None), out


@torch.no_grad()
def run_blocks(model: nn.Module, windows: torch.Tensor | None, on_block: OnBlock, cfg: CalibConfig,
               targets: Callable[[str], bool] | Collection[str] | None = None, hessian: bool = True,
               progress: bool = True, stream: BlockStream | None = None, teacher_targets: bool = False,
               block_done: Callable[[str], None] | None = None) -> dict[str, float]:
    """Run `windows` [n, seq_len] through the model block by block, in layer order.

    For each block `layers.K`: a statistics pass runs the block on its inputs (in batches of
    cfg.batch_size) with hooks on the selected linears (`targets`: full module names such as
    "layers.3.feed_forward.w1", or a predicate; None = all); then `on_block("layers.K", block, stats)`
    may modify the block in place, stats being {full linear name: LinearStats} (with cfg.true_sequential:
    once per group of linears sharing an input, in the order they run, each group's inputs computed through
    the groups before it as changed); then `block_done("layers.K")`, if given; then the next block's
    inputs are the block's outputs: recomputed with the modified block when cfg.sequential, else the
    statistics pass's (unmodified) outputs, with no extra forward. Blocks without a selected linear are
    still passed to on_block (with {}). With cfg.forward resolving to a dtype other than the block's, the
    passes run a copy of the block in that dtype, refreshed from the block after on_block. Returns seconds
    spent: forward_s (block forwards, hooks excluded), stats_s (accumulating statistics), on_block_s.
    With `stream` (models.streamed.StreamedModel), the model lives on the meta device and each module is
    loaded just before its pass and released (written out, freed) right after.
    teacher_targets: a second stream of activations runs every block as it was before on_block changed it
    (the teacher's own activations), and each LinearStats also sums C = X_dᵀX over the teacher's inputs to
    that linear and the model's (one more full block forward per batch, and C's products, which are not
    symmetric). Sequential calibration only: without it both streams are the teacher's.
    """
    if windows is None or windows.numel() == 0:
        raise SmeltError("no calibration data: run_blocks needs at least one window")
    if teacher_targets and cfg.true_sequential:
        raise SmeltError("teacher targets need the unchanged block's inputs to every linear: use them without "
                         "true_sequential calibration")
    if teacher_targets and not (cfg.sequential and hessian):
        raise SmeltError("teacher targets need sequential calibration with the Hessian (the model's inputs "
                         "differ from the teacher's only when earlier blocks were changed)")
    if windows.ndim != 2:
        raise SmeltError(f"calibration windows must be [n, seq_len] token ids, got shape {tuple(windows.shape)}")
    seq_len = windows.shape[1]
    if seq_len > model.rope_cos.shape[0]:
        raise SmeltError(f"calibration seq_len={seq_len} exceeds the model's max_seq_len={model.rope_cos.shape[0]}")
    device = calibration_device(model, stream)
    product = cfg.hessian_dtype(device)
    fwd_dtype = cfg.forward_dtype(device)
    selected = _selector(targets)
    widest = max((m.in_features for n, m in model.layers.named_modules()
                  if isinstance(m, nn.Linear) and selected(f"layers.{n}")), default=0)
    if hessian and windows.numel() < widest:
        # XᵀX over fewer tokens than inputs has rank < its size: singular unless dampened.
        print(f"warning: {windows.numel()} calibration tokens are fewer than the {widest} inputs of the widest "
              f"calibrated Linear: its Hessian is rank-deficient (use >= {widest} tokens, or rely on dampening)",
              file=sys.stderr)
    cos, sin = model.rope_cos[:seq_len], model.rope_sin[:seq_len]
    seconds = {"forward_s": 0.0, "stats_s": 0.0, "on_block_s": 0.0}
    was_training, bar = model.training, None
    model.eval()
    # cuBLAS may add a bf16 product's split-K partial sums in bf16; XᵀX's products run over thousands of
    # tokens, and the CPU measurements behind bf16 products accumulated each in fp32.
    bf16_reduction = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    try:
        # The current block's inputs, one tensor per batch; replaced in place by the block's outputs.
        if stream is not None:
            stream.load("tok_embeddings", model.tok_embeddings)
        hidden = [model.tok_embeddings(b.to(device)) for b in windows.split(cfg.batch_size)]
        if stream is not None:
            stream.release("tok_embeddings", model.tok_embeddings)
        teacher = list(hidden) if teacher_targets else None  # the same tensors until block 0 changes
        bar = tqdm(total=len(model.layers), desc="calibrate", unit="block", disable=not progress)
        for key, block in model.layers.items():
            prefix = f"layers.{key}"
            if stream is not None:
                stream.load(prefix, block)
            # What the passes run: the block itself, or a copy with linears in the forward dtype (the
            # algorithms keep modifying the block's own weights).
            fwd = block if next(block.parameters()).dtype == fwd_dtype else forward_copy(block, fwd_dtype)
            linears = {f"{prefix}.{n}": m for n, m in fwd.named_modules()
                       if isinstance(m, nn.Linear) and selected(f"{prefix}.{n}")}
            collector = _Collector(linears, hessian, product)
            one_pass = cfg.true_sequential and bool(linears)  # statistics, changes and outputs in one pass
            if one_pass:
                true_sequential.calibrate_block(prefix, block, fwd, hidden, cos, sin, collector, on_block, seconds)
            elif linears or not cfg.sequential:
                t0 = time.perf_counter()

                def teacher_batch(i: int, fwd=fwd, collector=collector) -> None:
                    with collector.capture_teacher():  # the unchanged block on the teacher's stream, inputs kept
                        teacher[i] = fwd(teacher[i], cos, sin)
                # Batch 0 finds the block's last Linear; in a sequential pass the rest stop there (its
                # output and what follows are recomputed with the modified block anyway).
                if teacher is not None:
                    teacher_batch(0)
                last, out = _last_linear(fwd, hidden[0], cos, sin, collector)
                collector.end_batch()
                if not cfg.sequential:
                    hidden[0] = out
                del out
                stop = None
                try:
                    with collector.attached():  # the stop hook after the collector's: stats first
                        if cfg.sequential and last is not None:
                            stop = last.register_forward_pre_hook(functools.partial(_stop_unless_capturing, collector))
                        for i in range(1, len(hidden)):
                            if teacher is not None:
                                teacher_batch(i)
                            try:
                                out = fwd(hidden[i], cos, sin)
                            except _StopPass:
                                out = None
                            collector.end_batch()
                            if not cfg.sequential:
                                hidden[i] = out
                            del out
                finally:
                    if stop is not None:
                        stop.remove()
                synchronize()
                seconds["forward_s"] += time.perf_counter() - t0 - collector.seconds
                seconds["stats_s"] += collector.seconds
            if not one_pass:
                t0 = time.perf_counter()
                on_block(prefix, block, collector.stats)
                seconds["on_block_s"] += time.perf_counter() - t0
            del collector  # free this block's statistics before the next block's
            if cfg.sequential and not one_pass:
                t0 = time.perf_counter()
                if fwd is not block:  # the modified weights, in the forward dtype
                    refresh(fwd, block)
                for i, h in enumerate(hidden):
                    hidden[i] = fwd(h, cos, sin)
                synchronize()
                seconds["forward_s"] += time.perf_counter() - t0
            if block_done is not None:
                block_done(prefix)
            if stream is not None:
                del fwd
                stream.release(prefix, block)
            bar.update()
    finally:
        if bar is not None:
            bar.close()  # before any error is printed, so the message stays the last line
        model.train(was_training)
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = bf16_reduction
        hidden = teacher = None
        release_memory()
    return seconds
