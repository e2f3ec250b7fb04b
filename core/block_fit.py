"""Block-wise fitting of a compressed model to the dense teacher: the maths and the block runner that
prune.reconstruct (masks kept, float weights) and qat.reconstruct (fake-quantized weights, learned scales) share.

Each block's MLP (gate, up and down projections), or all of its linears, is trained on its kept weights (masks
never change) to match the teacher's block. The loss is ‖f(x) − y‖² / ‖y‖² (normalised MSE, or against what the
block adds for a whole-block fit); each block keeps the epoch whose held-out windows' NMSE was lowest, or its
starting weights. `reconstruct_mlp` / `reconstruct_block` are the maths, `fit_blocks` runs the blocks and hands
each one's inputs and targets over, `fit_model` ties them for a stage's main().
"""
from __future__ import annotations

import math
import shutil
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from core.calibrate import (
    RECONSTRUCT_FITS,
    RECONSTRUCT_INPUTS,
    CalibConfig,
    add_sampling_arg,
    check_reconstruct,
)
from core.errors import ArgumentParser, SmeltError

# The calibration text by default: 64 x 512 windows of the training mix, 8 to a block forward (fit_blocks holds one
# block's fp32 activations at a time: a few 64 x 512 x 576 tensors, 75 MB each, on SmolLM2)
CALIB = CalibConfig(n_windows=64, seq_len=512, corpus="wikitext2-valid+code-train+zh-train", batch_size=8)


def part_masks(masks: dict[str, torch.Tensor], block: str, fit: str) -> dict[str, torch.Tensor]:
    """{linear name inside the fitted part: keep-mask} of one block's MLP (fit "mlp": "w1", ...) or of the whole
    block (fit "block": "attention.wq", "feed_forward.w1", ...) from an artifact's masks; absent: dense."""
    prefix = f"layers.{block}." + ("feed_forward." if fit == "mlp" else "")
    return {k[len(prefix):]: m for k, m in masks.items() if k.startswith(prefix)}


@dataclass(kw_only=True)
class ReconstructConfig:
    """Settings of the fit; each maps to the CLI flag of the same name."""

    # lr and epochs from a sweep on blocks 0, 14 and 29 of SmolLM2's SparseGPT 2:4 (lr 3e-5 to 3e-3, 4 and 8
    # epochs; results/bench/reconstruct/lr-sweep-*.json): held-out NMSE fell with lr up to 3e-3; there 8 epochs were
    # 1-10% lower than 4, at twice the time
    epochs: int = 4
    lr: float = 3e-3             # AdamW, betas (0.9, 0.95), decayed linearly to 0 over the fit
    batch_tokens: int = 512      # tokens per step: small batches, many steps (the calibration set is small)
    holdout: float = 0.1         # share of the windows held out to choose the epoch
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    seed: int = 0
    inputs: str = RECONSTRUCT_INPUTS[0]  # what each block is fitted on: teacher, student, block (fit_blocks)
    fit: str = RECONSTRUCT_FITS[0]       # what is trained: mlp (its linears), block (every linear of the block)

    def __post_init__(self):
        for name, lo in (("epochs", 1), ("batch_tokens", 1), ("seed", 0)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise SmeltError(f"--{name.replace('_', '-')}={v!r} must be an integer >= {lo}")
        if not self.lr > 0:
            raise SmeltError(f"--lr={self.lr} must be > 0")
        if not 0 < self.holdout < 1:
            raise SmeltError(f"--holdout={self.holdout} must be in (0, 1)")
        check_reconstruct(self.inputs, self.fit, "--")
        if self.weight_decay < 0 or not self.max_grad_norm > 0:
            raise SmeltError(f"--weight-decay={self.weight_decay} must be >= 0 and --max-grad-norm="
                             f"{self.max_grad_norm} > 0")

    def param_groups(self, linears: dict[str, nn.Linear]) -> list[dict]:
        """The optimizer's parameter groups for the fitted part's linears: their weights at `lr`."""
        return [{"params": [m.weight for m in linears.values()], "lr": self.lr}]


@torch.no_grad()
def fit_nmse(f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, y: torch.Tensor, residual: bool = False,
             batch: int = 4096, device: torch.device | None = None) -> float:
    """‖f(x) − y‖² / ‖y‖², or with `residual` (f returns x plus what it adds) ‖f(x) − y‖² / ‖y − x‖², over the
    first dimension of x and y in batches (fp32 sums), on `device` (default: f's if a module, else x's). A block's
    stream dwarfs what the block adds: measured against the stream, any fit would look close."""
    err = ref = 0.0
    dev = device or (next(f.parameters()).device if isinstance(f, nn.Module) else x.device)
    for s in range(0, x.shape[0], batch):
        xb, yb = x[s:s + batch].to(dev).float(), y[s:s + batch].to(dev).float()
        err += float((f(xb) - yb).pow(2).sum())
        ref += float((yb - xb if residual else yb).pow(2).sum())
    return err / ref


def _split(n_windows: int, cfg: ReconstructConfig, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(held-out, training) window indices: a random `holdout` share of the windows, at least one."""
    windows = torch.randperm(n_windows, generator=gen)
    n_hold = max(1, round(n_windows * cfg.holdout)) if n_windows > 1 else 0
    return windows[:n_hold], windows[n_hold:]


def _fit(module: nn.Module, f: Callable[[torch.Tensor], torch.Tensor], masks: dict[str, torch.Tensor],
         x: torch.Tensor, y: torch.Tensor, residual: bool, train: torch.Tensor, hold: torch.Tensor, batch: int,
         eval_batch: int, cfg: ReconstructConfig, gen: torch.Generator) -> dict:
    """Train every nn.Linear weight in `module` (the masked ones on their kept entries; with what else
    cfg.param_groups adds) so that f(x[i]) ≈ y[i],
    `batch` indices of `train` a step (fit_nmse's `residual`); keep the epoch with the lowest held-out NMSE, or the
    starting weights."""
    linears = {n: m for n, m in module.named_modules() if isinstance(m, nn.Linear)}
    if bad := sorted(set(masks) - set(linears)):
        raise SmeltError(f"mask {bad[0]} names no linear of the fitted part")
    for k, m in masks.items():
        if m.shape != linears[k].weight.shape:
            raise SmeltError(f"mask of {k} has shape {tuple(m.shape)}, the weight {tuple(linears[k].weight.shape)}")
    groups = cfg.param_groups(linears)
    params = [p for g in groups for p in g["params"]]
    dev = params[0].device
    keep = {k: m.to(dev) for k, m in masks.items()}

    def nmse(idx: torch.Tensor) -> float:
        return fit_nmse(f, x[idx], y[idx], residual, eval_batch, dev)

    before = {"train": nmse(train), "heldout": nmse(hold)}
    best, best_state, best_epoch = before["heldout"], [p.detach().clone() for p in params], 0
    total = cfg.epochs * math.ceil(len(train) / batch)
    opt = torch.optim.AdamW(groups, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / total)
    with torch.enable_grad():
        for epoch in range(1, cfg.epochs + 1):
            order = train[torch.randperm(len(train), generator=gen)]
            for s in range(0, len(order), batch):
                idx = order[s:s + batch]
                xb, yb = x[idx].to(dev).float(), y[idx].to(dev).float()
                loss = (f(xb) - yb).pow(2).sum() / (yb - xb if residual else yb).pow(2).sum()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
                opt.step()
                sched.step()
                with torch.no_grad():
                    for k, m in keep.items():  # a pruned weight stays exactly 0 (decay and Adam's moments aside)
                        linears[k].weight.mul_(m)
            held = nmse(hold)
            if held < best:
                best, best_state, best_epoch = held, [p.detach().clone() for p in params], epoch
    with torch.no_grad():
        for p, v in zip(params, best_state):
            p.copy_(v)
    return {"before": before, "after": {"train": nmse(train), "heldout": nmse(hold)}, "epoch_kept": best_epoch,
            "steps": total}


def reconstruct_mlp(mlp: nn.Module, masks: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor,
                    cfg: ReconstructConfig, tokens_per_window: int | None = None) -> dict:
    """Fit mlp's w1/w2/w3 kept weights (masks {"w1"|"w2"|"w3": bool keep}, absent: dense) to map x [N, d] onto
    y [N, d], in place, `cfg.batch_tokens` rows a step. Rows are split into training and held-out windows of
    `tokens_per_window` rows (one window's tokens stay together: neighbours are not independent); the weights
    after the epoch with the lowest held-out NMSE are kept, or the starting ones. Returns the NMSE before and
    after on both splits."""
    gen = torch.Generator().manual_seed(cfg.seed)
    n = x.shape[0]
    per = tokens_per_window or n
    if n % per:
        raise SmeltError(f"{n} rows are not whole windows of {per} tokens")
    hold_w, train_w = _split(n // per, cfg, gen)
    if len(hold_w) == 0:  # one window: hold out its last tenth instead
        cut = max(1, round(n * cfg.holdout))
        hold, train = torch.arange(n - cut, n), torch.arange(n - cut)
    else:
        hold, train = ((w[:, None] * per + torch.arange(per)).reshape(-1) for w in (hold_w, train_w))
    return _fit(mlp, mlp, masks, x, y, False, train, hold, cfg.batch_tokens, 4096, cfg, gen)


def reconstruct_block(block: nn.Module, masks: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, cfg: ReconstructConfig) -> dict:
    """Fit every linear of a transformer block (masks {"attention.wq"|...|"feed_forward.w1"|...: bool keep}, absent:
    dense) so that block(x) maps its inputs x [n, L, d] onto y [n, L, d], in place; whole windows (attention
    mixes a window's tokens), cfg.batch_tokens // L of them a step. The loss is NMSE against what the block must
    add (y − x). The norms stay: their gains are per-input-channel scales the kept weights already express.
    Held-out windows, the epoch kept and the returned record as reconstruct_mlp's."""
    if x.shape[0] < 2:
        raise SmeltError(f"a block fit needs at least 2 windows (one held out), got {x.shape[0]}")
    gen = torch.Generator().manual_seed(cfg.seed)
    hold, train = _split(x.shape[0], cfg, gen)
    per = x.shape[1]
    return _fit(block, lambda h: block(h, cos, sin), masks, x, y, True, train, hold, max(1, cfg.batch_tokens // per),
                max(1, 4096 // per), cfg, gen)


@torch.no_grad()
def fit_blocks(teacher: nn.Module, student: nn.Module, windows: torch.Tensor, batch_size: int, blocks: list[str],
               inputs: str, fit: Callable[[str, torch.Tensor, torch.Tensor], None], part: str = "mlp") -> None:
    """Run `windows` [n, L] through the teacher's blocks (and, unless inputs == "teacher", the student's) one block
    at a time, and call fit(block, x, y) for each block in `blocks`, in layer order. With part "mlp", x and y are
    [N, d] MLP inputs and targets:
    - "teacher": x, y = the teacher's MLP inputs and outputs (the blocks are independent);
    - "student": x = the student's MLP inputs through its blocks as fitted so far, y = the teacher's MLP outputs;
    - "block":   x as "student", y = what the MLP must add for the block to output the teacher's block output
      (EBFT's target with the MLP as the trained part: it also corrects what earlier blocks left).
    With part "block", x and y are [n, L, d] block inputs (the teacher's, or with "block" the student's own) and
    the teacher's block outputs ("student" would be "block" again: refused).
    After fit, the student's stream continues through the block as fitted; blocks after the last one in `blocks` are
    not run. One block's activations are held at a time (fp32, on the model's device, where x and y stay too)."""
    check_reconstruct(inputs, part, "--")
    dev = teacher.tok_embeddings.weight.device
    seq_len, d = windows.shape[1], teacher.cfg.dim
    cos, sin = teacher.rope_cos[:seq_len], teacher.rope_sin[:seq_len]
    batches = list(windows.split(batch_size))
    h_t = [teacher.tok_embeddings(b.to(dev)).float() for b in batches]
    h_s = [student.tok_embeddings(b.to(dev)).float() for b in batches] if inputs != "teacher" else None

    def attend(block: nn.Module, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mid = h + block.attention(block.attention_norm(h), cos, sin)  # the residual after attention
        return mid, block.ffn_norm(mid)                                 # and the MLP's input

    todo = set(blocks)
    for key in tqdm(list(student.layers), desc=f"{part} reconstruction ({inputs} inputs)", file=sys.stderr):
        if not todo:
            break
        if part == "block":
            xs = h_s if h_s is not None else h_t  # h_t is rebound below, xs keeps the block's inputs
            h_t = [teacher.layers[key](h, cos, sin) for h in h_t]
            if key in todo:
                todo.discard(key)
                fit(key, torch.cat(xs), torch.cat(h_t))
            if h_s is not None:
                h_s = [student.layers[key](h, cos, sin) for h in h_s]
            continue
        xs, ys, mids = [], [], []
        for i in range(len(batches)):
            mid_t, x_t = attend(teacher.layers[key], h_t[i])
            y_t = teacher.layers[key].feed_forward(x_t)
            h_t[i] = mid_t + y_t
            if h_s is None:
                xs.append(x_t)
                ys.append(y_t)
                continue
            mid_s, x_s = attend(student.layers[key], h_s[i])
            xs.append(x_s)
            ys.append(y_t if inputs == "student" else h_t[i] - mid_s)
            mids.append(mid_s)
        if key in todo:
            todo.discard(key)
            fit(key, torch.cat(xs).reshape(-1, d), torch.cat(ys).reshape(-1, d))
        if h_s is not None:
            for i in range(len(batches)):
                h_s[i] = mids[i] + student.layers[key].feed_forward(xs[i])


def fit_parser(prog: str, description: str, artifact_help: str, teacher: str,
               config: type[ReconstructConfig]) -> ArgumentParser:
    """A fitting stage's CLI: --artifact, --teacher (default `teacher`), --out, --overwrite and add_fit_args'."""
    ap = ArgumentParser(prog=prog, description=description)
    ap.add_argument("--artifact", required=True, help=artifact_help)
    ap.add_argument("--teacher", default=teacher,
                    help="the model whose blocks are matched: the teacher, or any float model of the same shapes")
    ap.add_argument("--out", required=True)
    ap.add_argument("--overwrite", action="store_true")
    add_fit_args(ap, config)
    return ap


def check_paths(src: Path, out: Path, overwrite: bool) -> None:
    """--out must not exist (unless --overwrite) and must not be the --artifact."""
    if out.exists() and not overwrite:
        raise SmeltError(f"output directory {out} already exists (pass --overwrite to replace it)")
    if out.resolve() == src.resolve():
        raise SmeltError(f"--out {out} is the --artifact itself")


def check_masks_kept(student: nn.Module, masks: dict[str, torch.Tensor]) -> None:
    """The fit must not have revived a pruned weight (a bug if it did)."""
    for name, m in masks.items():
        if bool((student.get_submodule(name).weight.detach().cpu()[~m.cpu()] != 0).any()):
            raise SmeltError(f"{name}: a pruned weight is non-zero after the fit (a bug)")


def copy_side_files(src: Path, dst: Path, rewritten: tuple[str, ...]) -> None:
    """Every file of the source artifact (masks, tokenizer, chat template, MTP modules) but the weights, config,
    record and the `rewritten` ones, into the artifact being written."""
    for f in src.iterdir():
        if f.is_file() and f.name not in ("model.safetensors", "config.json", "manifest.json", *rewritten):
            shutil.copy2(f, dst / f.name)


def add_fit_args(ap, config: type[ReconstructConfig]) -> None:
    """A stage's flags: --blocks, the calibration text's (CALIB's defaults), and one per `config` field."""
    ap.add_argument("--blocks", default="", help="comma-separated block indices (default: every block)")
    ap.add_argument("--calib-windows", type=int, default=CALIB.n_windows)
    ap.add_argument("--calib-seq-len", type=int, default=CALIB.seq_len)
    ap.add_argument("--calib-corpus", default=CALIB.corpus)
    ap.add_argument("--calib-seed", type=int, default=CALIB.seed)
    add_sampling_arg(ap)
    ap.add_argument("--capture-batch", type=int, default=CALIB.batch_size, help="windows per block forward")
    for f in config.__dataclass_fields__.values():
        ap.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)


def fit_settings(args, config: type[ReconstructConfig]) -> tuple[ReconstructConfig, CalibConfig]:
    """(the fit's config, the calibration's) from add_fit_args' flags, validated."""
    cfg = config(**{k: getattr(args, k) for k in config.__dataclass_fields__})
    calib = CalibConfig(n_windows=args.calib_windows, seq_len=args.calib_seq_len, seed=args.calib_seed,
                        corpus=args.calib_corpus, sampling=args.calib_sampling, batch_size=args.capture_batch)
    return cfg, calib


def check_pair(teacher: nn.Module, student: nn.Module, teacher_name: str, src) -> None:
    """The student's blocks must be the teacher's, one for one (a depth-removed model has no block targets)."""
    if teacher.cfg.dim != student.cfg.dim or list(teacher.layers) != list(student.layers):
        raise SmeltError(f"--teacher {teacher_name} has other blocks than {src} (depth removal: fit before it)")


def parse_blocks(arg: str, student: nn.Module, src) -> list[str]:
    """--blocks "0,14,29" as block keys of the student (empty: all), or a one-line error."""
    try:
        blocks = [str(int(b)) for b in arg.split(",") if b.strip()] or list(student.layers)
    except ValueError:
        raise SmeltError(f"--blocks {arg!r} is not a comma-separated list of block indices") from None
    if bad := [b for b in blocks if b not in student.layers]:
        raise SmeltError(f"--blocks: {bad[0]} is not a block of {src} (0..{len(student.layers) - 1})")
    return blocks


def fit_model(teacher: nn.Module, student: nn.Module, masks: dict[str, torch.Tensor], windows: torch.Tensor,
              calib: CalibConfig, cfg: ReconstructConfig, blocks: list[str]) -> dict:
    """Fit the student's `blocks` in place (cfg.fit's part of each, on cfg.inputs), block by block in layer order;
    returns {block: its fit's record} and logs each block's NMSE."""
    report = {}
    rope = (student.rope_cos[:calib.seq_len], student.rope_sin[:calib.seq_len])  # a block fit's positions

    def fit_one(b: str, x: torch.Tensor, y: torch.Tensor) -> None:
        if cfg.fit == "mlp":
            r = reconstruct_mlp(student.layers[b].feed_forward, part_masks(masks, b, "mlp"), x, y, cfg, calib.seq_len)
        else:
            r = reconstruct_block(student.layers[b], part_masks(masks, b, "block"), x, y, *rope, cfg)
        report[b] = r
        print(f"block {b}: NMSE held out {r['before']['heldout']:.5f} -> {r['after']['heldout']:.5f} "
              f"(train {r['before']['train']:.5f} -> {r['after']['train']:.5f}; epoch {r['epoch_kept']})",
              file=sys.stderr)

    fit_blocks(teacher, student, windows, calib.batch_size, blocks, cfg.inputs, fit_one, cfg.fit)
    return report


def fit_record(cfg: ReconstructConfig, calib: CalibConfig, device, blocks: list[str], teacher: str, report: dict,
               seconds: float, peak_rss_gib: float) -> tuple[dict, dict]:
    """(settings, metrics) of a fitting stage's manifest."""
    return ({**asdict(cfg), "blocks": blocks, "teacher": teacher, "calibration": calib.record(device)},
            {"per_block": report, "seconds": round(seconds, 1), "peak_rss_gib": round(peak_rss_gib, 3)})
