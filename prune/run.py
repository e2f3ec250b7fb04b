"""Prune a teacher's transformer-block linears and write the result as a smelt artifact.

    python -m prune.run --teacher smollm2-135m --method sparsegpt --pattern 2:4 --out runs/pruned --eval
    python -m prune.run --method wanda --sparsity 0.5 --out runs/wanda50 --calib-windows 64 --no-sequential

Methods: magnitude (no calibration), wanda, sparsegpt, obs (exact, slow; small models only). The
artifact is an HF directory plus masks.safetensors (keep-masks for recovery training) and manifest.json
with per-module sparsity and relative reconstruction error tr(ΔW H ΔWᵀ) / tr(W H Wᵀ).

`--refit layer` re-solves the kept weights of every pruned linear to the exact layer-wise optimum for its mask
(algorithms.masked_refit): SparseGPT's sweep compensates only later columns, Wanda updates nothing.
`--refit teacher` fits them to the teacher's own output at that layer instead (core.calibrate's teacher
targets: one more block forward per batch), so each layer also absorbs what earlier layers' pruning changed.

`--protect heads.json` (prune.heads) leaves the protected heads' rows of wq/wk/wv dense and declares them
in masks.safetensors (core.protected, core.masks): every pruner here treats rows independently, so a
dense row is exactly what it would have been with nothing pruned in it.
"""
from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from configs.schema import build
from core.artifact import weights_fingerprint, write_manifest
from core.calibrate import (
    REFIT_TARGETS,
    CalibConfig,
    add_precision_args,
    add_sampling_arg,
    calibration_device,
    run_blocks,
    shared_inputs,
)
from core.data import EvalConfig, parse_windows
from core.device import default_device, peak_device_memory_gib, peak_rss_gib, release_memory, synchronize
from core.errors import ArgumentParser, SmeltError, run_cli
from core.evaluation import evaluate_dir
from core.files import atomic_dir
from core.linear_stats import LinearStats
from core.masks import StreamedMasks
from core.obs import timed_inverses
from core.patterns import NMPattern
from core.protected import dense_rows as protected_rows
from core.protected import read_protected
from core.sidefiles import closed_at_end
from models.hf_io import load_hf, load_tokenizer, save_hf
from models.llama import DEFAULT_SKIP, linear_names
from models.streamed import StreamedModel, blocks_in_order, check_memory
from models.teacher import DEFAULT_TEACHER, resolve_teacher
from prune import algorithms
from prune.patterns import check_sparsity

METHODS = ("magnitude", "wanda", "sparsegpt", "obs")
CALIBRATED = ("wanda", "sparsegpt", "obs")
HESSIAN_METHODS = ("sparsegpt", "obs")  # the methods that invert H (so does --refit)
REFITTABLE = ("wanda", "sparsegpt")  # OBS's weights are already the optimum for its mask; magnitude has no H


def prune_targets(model: nn.Module, skip: tuple[str, ...] = DEFAULT_SKIP) -> list[str]:
    """The linears to prune: every nn.Linear not matched by `skip`; each must sit in a transformer block."""
    targets = linear_names(model, skip, field="--skip")
    outside = [n for n in targets if not n.startswith("layers.")]
    if outside:
        raise SmeltError(f"{outside[0]} is outside the transformer blocks and cannot be pruned "
                         f"(add it to --skip)")
    if not targets:
        raise SmeltError("nothing to prune: --skip excludes every linear")
    return targets


def relative_error(W: torch.Tensor, W_hat: torch.Tensor, H: torch.Tensor) -> float:
    """||XWᵀ − XŴᵀ||² / ||XWᵀ||² over the calibration inputs, from H = XᵀX alone."""
    dt = torch.promote_types(H.dtype, torch.float32)  # a bf16 H is measured in fp32
    H, W64, D = H.to(dt), W.to(dt), (W - W_hat).to(dt)
    den = float(((W64 @ H) * W64).sum())
    return float(((D @ H) * D).sum()) / den if den > 0 else 0.0


def _prune_weight(method: str, W: torch.Tensor, stats: LinearStats | None, sparsity: float,
                  pattern: NMPattern | None, blocksize: int, percdamp: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    if method == "magnitude":
        return algorithms.magnitude_prune(W, sparsity, pattern)
    if method == "wanda":
        return algorithms.wanda_prune(W, stats.act_norm, sparsity, pattern)
    if method == "sparsegpt":
        return algorithms.sparsegpt_prune(W, stats.H, sparsity, pattern, blocksize, percdamp)
    return algorithms.obs_prune(W, stats.H, sparsity, pattern, percdamp)


def check_settings(model: nn.Module, method: str, sparsity: float, pattern: NMPattern | None = None,
                   skip: tuple[str, ...] = DEFAULT_SKIP, blocksize: int = 128, percdamp: float = 0.01,
                   refit: str | None = None) -> list[str]:
    """Validate everything that does not need data; returns the target linears. Fails before any
    tokenizing or forward pass, not after calibrating half the model."""
    targets = prune_targets(model, tuple(skip))
    if method not in METHODS:
        raise SmeltError(f"unknown method {method!r} (choose from {', '.join(METHODS)})")
    check_sparsity(sparsity)
    modules = dict(model.named_modules())
    if pattern is not None:
        for name in targets:
            pattern.check_fits(modules[name].in_features, name)
    m = pattern.m if pattern else 0
    if method == "sparsegpt" and (not isinstance(blocksize, int) or blocksize <= 0 or (m and blocksize % m)):
        raise SmeltError(f"blocksize={blocksize} must be a positive integer" + (f" multiple of M={m}" if m else ""))
    if not (math.isfinite(percdamp) and percdamp >= 0):
        raise SmeltError(f"percdamp={percdamp} must be a finite number >= 0 (e.g. 0.01)")
    if refit is not None and refit not in REFIT_TARGETS:
        raise SmeltError(f"refit={refit!r} is not one of {', '.join(REFIT_TARGETS)}")
    if refit and method not in REFITTABLE:
        raise SmeltError(f"refit needs a method whose weights are not already optimal for its mask "
                         f"({', '.join(REFITTABLE)}), got {method!r}")
    return targets


@torch.no_grad()
def prune_model(model: nn.Module, windows: torch.Tensor | None, method: str, sparsity: float = 0.5,
                pattern: NMPattern | None = None, skip: tuple[str, ...] = DEFAULT_SKIP, blocksize: int = 128,
                percdamp: float = 0.01, cfg: CalibConfig | None = None, progress: bool = True,
                dense_rows: dict[str, torch.Tensor] | None = None, stream: StreamedModel | None = None,
                write_masks: Callable[[dict[str, torch.Tensor]], None] | None = None, refit: str | None = None,
                ) -> tuple[dict[str, torch.Tensor], dict]:
    """Prune the model's block linears in place; returns ({module name: bool keep-mask}, report).

    An N:M `pattern` sets the sparsity (1 - n/m); without one it is unstructured at `sparsity`. windows
    [n_windows, seq_len] feed the calibrated methods (magnitude ignores them and runs no forward pass).
    report: per_module {name: {sparsity, rel_recon_error (methods with a Hessian: SparseGPT, OBS)}}, overall sparsity of
    the pruned linears, and timings_s (forward passes, statistics, Hessian inverses, pruning updates).
    dense_rows {name: bool [out]}: rows left as they are (all kept), e.g. protected heads.
    stream: the model is a StreamedModel's (meta until each block is loaded).
    write_masks: each block's masks go to it as soon as the block is done (streamed or not: the run then
    holds no byte per weight), and the returned masks are empty.
    refit: the kept weights re-solved to the layer-wise optimum for the mask (algorithms.masked_refit):
    "layer" for the layer's own output on its current inputs, "teacher" for the teacher's output there.
    """
    t_start = time.perf_counter()
    cfg = cfg or CalibConfig()
    if pattern is not None:
        sparsity = pattern.sparsity
    targets = check_settings(model, method, sparsity, pattern, skip, blocksize, percdamp, refit)
    if method in HESSIAN_METHODS or refit:
        cfg.check_dampening(percdamp, calibration_device(model, stream))
    dense_rows = dense_rows or {}
    if set(dense_rows) - set(targets):
        raise SmeltError(f"dense rows declared for {sorted(set(dense_rows) - set(targets))[0]}, which is not pruned")
    modules = dict(model.named_modules())
    masks: dict[str, torch.Tensor] = {}
    per_module: dict[str, dict] = {}
    removed: dict[str, int] = {}  # pruned weights per module (the masks may be gone: streamed)
    seconds = {"forward_s": 0.0, "stats_s": 0.0, "hessian_inverse_s": 0.0, "prune_s": 0.0, "metrics_s": 0.0}
    if refit:
        seconds["refit_s"] = 0.0
    refits: dict[str, dict] = {}  # the first linear of a group (or the linear) -> masked_refit's info

    def prune_and_refit(name: str, W: torch.Tensor, stats: LinearStats | None) -> tuple[torch.Tensor, torch.Tensor]:
        W_hat, keep = _prune_weight(method, W, stats, sparsity, pattern, blocksize, percdamp)
        if refit:
            t0 = time.perf_counter()
            W_hat, refits[name] = algorithms.masked_refit(W, W_hat, stats.H, keep, percdamp, cross=stats.C)
            seconds["refit_s"] += time.perf_counter() - t0
        return W_hat, keep

    def prune_one(name: str, stats: LinearStats | None) -> None:
        t0 = time.perf_counter()
        try:
            W_hat, keep = prune_and_refit(name, modules[name].weight.detach(), stats)
        except SmeltError as e:
            raise SmeltError(f"{name}: {e}") from None
        synchronize()  # the sweep's queued GPU kernels are its time
        seconds["prune_s"] += time.perf_counter() - t0
        finish(name, W_hat, keep, stats)

    def finish(name: str, W_hat: torch.Tensor, keep: torch.Tensor, stats: LinearStats | None) -> None:
        """Declared dense rows, the metrics, and the pruned weight written back in place."""
        weight = modules[name].weight
        t0 = time.perf_counter()
        entry = {}
        if name in dense_rows:  # rows are pruned independently: a dense row is the untouched row
            rows = dense_rows[name].to(keep.device)
            W_hat[rows], keep[rows] = weight.detach()[rows].to(W_hat.dtype), True
            entry["dense_rows"] = int(rows.sum())
        t1 = time.perf_counter()
        entry["sparsity"] = 1.0 - keep.sum().item() / keep.numel()
        if stats is not None and stats.xtx is not None:
            entry["rel_recon_error"] = relative_error(weight.detach(), W_hat, stats.H)
        weight.copy_(W_hat)  # in place: tied or shared parameters stay the same object
        masks[name] = keep.cpu()
        removed[name] = int((~keep).sum())
        per_module[name] = entry
        seconds["prune_s"] += t1 - t0
        seconds["metrics_s"] += time.perf_counter() - t1

    def prune_group(group: list[str], stats: LinearStats) -> None:
        """N:M SparseGPT picks masks within each row, so linears sharing an input (wq/wk/wv, w1/w3) take
        one sweep over their stacked rows: one H inverse, a third of the column loops, the same result."""
        lins = [modules[n] for n in group]
        t0 = time.perf_counter()
        W = torch.cat([lin.weight.detach() for lin in lins])
        try:
            W_hat, keep = prune_and_refit(group[0], W, stats)
        except SmeltError as e:
            raise SmeltError(f"{group[0]} (+{len(group) - 1} sharing its input): {e}") from None
        synchronize()
        seconds["prune_s"] += time.perf_counter() - t0
        sizes = [lin.out_features for lin in lins]
        for name, w_i, k_i in zip(group, W_hat.split(sizes), keep.split(sizes), strict=True):
            finish(name, w_i.contiguous(), k_i.contiguous(), stats)

    def on_block(block_name: str, block: nn.Module, stats: dict[str, LinearStats]) -> None:
        for group in shared_inputs(stats):
            if method == "sparsegpt" and pattern is not None and len(group) > 1:
                prune_group(group, stats[group[0]])
            else:
                for name in group:
                    prune_one(name, stats[name])

    def block_done(block_name: str) -> None:
        if write_masks is not None:  # this block's masks leave now, not at the end
            write_masks({n: masks.pop(n) for n in list(masks) if n.startswith(block_name + ".")})

    with timed_inverses(seconds):
        if method in CALIBRATED:
            if windows is None or windows.numel() == 0:
                raise SmeltError(f"no calibration data: {method} needs calibration windows")
            # Wanda reads activation norms only: no XᵀX (it cost ~40% of a calibration), so no H-based
            # reconstruction error is reported for it either.
            ran = run_blocks(model, windows, on_block, cfg, targets=set(targets), progress=progress,
                             hessian=method != "wanda" or bool(refit), stream=stream,
                             teacher_targets=refit == "teacher",
                             block_done=block_done)
            seconds["forward_s"], seconds["stats_s"] = ran["forward_s"], ran["stats_s"]
        else:  # magnitude: block by block, its masks leaving with it
            for prefix, _ in blocks_in_order(model, stream):
                for name in (n for n in targets if n.startswith(prefix + ".")):
                    prune_one(name, None)
                block_done(prefix)
    seconds["prune_update_s"] = seconds.pop("prune_s") - seconds["hessian_inverse_s"] - seconds.get("refit_s", 0.0)
    seconds["total_s"] = time.perf_counter() - t_start
    pruned, total = sum(removed.values()), sum(modules[n].weight.numel() for n in removed)
    # the pattern goes into manifests as its "2:4" string, as existing artifacts have it
    report = {"method": method, "pattern": str(pattern) if pattern else None, "sparsity": pruned / total,
              "pruned_params": pruned, "total_params": total, "per_module": per_module,
              "timings_s": {k: round(v, 3) for k, v in seconds.items()}}
    if refit:  # masked_refit's record per solve (a group of linears sharing an input is one)
        report["refit"] = refits
    return masks, report


def _parse_args(argv):
    ap = ArgumentParser(prog="python -m prune.run", description=__doc__.split("\n")[0])
    ap.add_argument("--teacher", default=DEFAULT_TEACHER, help="registered name, .gguf or HF directory")
    ap.add_argument("--method", required=True, help=f"one of {', '.join(METHODS)}")
    amount = ap.add_mutually_exclusive_group(required=True)
    amount.add_argument("--sparsity", type=float, help="unstructured sparsity in [0, 1)")
    amount.add_argument("--pattern", help="N:M semi-structured sparsity, e.g. 2:4")
    ap.add_argument("--out", required=True, help="artifact directory to write")
    ap.add_argument("--calib-windows", type=int, default=CalibConfig.n_windows)
    ap.add_argument("--calib-seq-len", type=int, default=CalibConfig.seq_len)
    ap.add_argument("--calib-batch-size", type=int, default=CalibConfig.batch_size)
    ap.add_argument("--calib-corpus", default=CalibConfig.corpus,
                    help="training corpus or a '+'-joined mix (wikitext2-valid+code-train+zh-train), a local "
                         "text/jsonl/parquet file or folder, or hf:<dataset>")
    ap.add_argument("--seed", type=int, default=CalibConfig.seed)
    add_sampling_arg(ap)
    add_precision_args(ap)
    ap.add_argument("--blocksize", type=int, default=128, help="SparseGPT column block")
    ap.add_argument("--percdamp", type=float, default=0.01, help="Hessian dampening, fraction of mean(diag H)")
    ap.add_argument("--refit", choices=REFIT_TARGETS,
                    help="re-solve the kept weights to the exact optimum for the mask (sparsegpt, wanda): of the "
                         "layer's own output (layer) or of the teacher's output at that layer (teacher; on SmolLM2 "
                         "it broke the model: docs/pruning.md)")
    ap.add_argument("--skip", default=",".join(DEFAULT_SKIP),
                    help="comma-separated module names, dotted prefixes or suffixes to leave dense")
    ap.add_argument("--protect", metavar="HEADS_JSON",
                    help="prune.heads JSON: leave its protected heads' wq/wk/wv rows dense (declared in the masks)")
    ap.add_argument("--no-sequential", action="store_true",
                    help="calibrate every block on the dense model's activations (one forward per block)")
    ap.add_argument("--calib-true-sequential", action="store_true",
                    help="calibrate each group of a block's linears on inputs through the groups already pruned "
                         "(one forward per block; more activations held)")
    ap.add_argument("--max-memory", type=float, metavar="GIB",
                    help="stream the model: blocks read from the checkpoint one at a time and the artifact "
                         "written block by block, refused unless the calibration's estimated footprint fits GIB "
                         "(on a GPU: of GPU memory, and the GPU's free memory)")
    ap.add_argument("--overwrite", action="store_true")
    ap.add_argument("--eval", action="store_true", help="evaluate against the teacher (metrics in the manifest)")
    ap.add_argument("--eval-windows", help="per-bucket eval windows, e.g. en=16,zh=8,code=8 (EvalConfig default)")
    ap.add_argument("--eval-seq-len", type=int, help="eval window length (EvalConfig default)")
    # 1, not EvalConfig's 4: on the 135M teacher, 4 raised the evaluation's peak RSS by ~0.9 GB (fp32
    # [tokens, vocab] logits and per-chunk temporaries) and was no faster on CPU
    ap.add_argument("--eval-batch-size", type=int, default=1)
    return ap.parse_args(argv)


def _summary(method: str, report: dict) -> str:
    line = f"[smelt] {method} pruned {len(report['per_module'])} linears to sparsity {report['sparsity']:.4f}"
    errors = {k: v["rel_recon_error"] for k, v in report["per_module"].items() if "rel_recon_error" in v}
    if errors:
        worst = max(errors, key=errors.get)
        line += (f"; rel. reconstruction error mean {sum(errors.values()) / len(errors):.4f}, "
                 f"max {errors[worst]:.4f} ({worst})")
    return line + f"; timings {report['timings_s']}"


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    if args.method not in METHODS:
        raise SmeltError(f"unknown method {args.method!r} (choose from {', '.join(METHODS)})")
    pattern = NMPattern.parse(args.pattern) if args.pattern is not None else None
    sparsity = pattern.sparsity if pattern else args.sparsity
    check_sparsity(sparsity)
    if args.refit == "teacher" and args.no_sequential:  # the teacher's inputs would be the model's own
        raise SmeltError("--refit teacher needs sequential calibration (drop --no-sequential)")
    if args.refit == "teacher" and args.calib_true_sequential:  # the teacher stream runs unchanged blocks whole
        raise SmeltError("--refit teacher needs the block-at-a-time order (drop --calib-true-sequential)")
    if args.no_sequential and args.calib_true_sequential:
        raise SmeltError("--calib-true-sequential needs sequential calibration (drop --no-sequential)")
    cfg = CalibConfig(n_windows=args.calib_windows, seq_len=args.calib_seq_len, seed=args.seed,
                      batch_size=args.calib_batch_size, sequential=not args.no_sequential,
                      corpus=args.calib_corpus, sampling=args.calib_sampling, forward=args.calib_forward,
                      hessian=args.calib_hessian, true_sequential=args.calib_true_sequential)
    if args.method in HESSIAN_METHODS or args.refit:
        cfg.check_dampening(args.percdamp, default_device())
    skip = tuple(s.strip() for s in args.skip.split(",") if s.strip())
    eval_overrides = {"batch_size": args.eval_batch_size}
    if args.eval_windows:
        eval_overrides["windows"] = parse_windows(args.eval_windows)
    if args.eval_seq_len is not None:
        eval_overrides["seq_len"] = args.eval_seq_len
    eval_cfg = build(EvalConfig, eval_overrides)
    out = Path(args.out)
    if out.exists() and not args.overwrite:
        raise SmeltError(f"output directory {out} already exists (pass --overwrite to replace it)")

    teacher_dir = resolve_teacher(args.teacher)
    if out.resolve() == teacher_dir.resolve():
        raise SmeltError(f"--out {out} is the teacher directory itself")
    tokenizer = load_tokenizer(teacher_dir)
    calibrated = args.method in CALIBRATED
    before_model = peak_rss_gib()  # interpreter, torch, tokenizer: what no --max-memory can cut
    stream = StreamedModel(teacher_dir, default_device()) if args.max_memory is not None else None
    model = stream.model if stream else load_hf(teacher_dir, device=str(default_device()))
    targets = check_settings(model, args.method, sparsity, pattern, skip, args.blocksize, args.percdamp, args.refit)
    need = check_memory(stream, args.max_memory, cfg.n_windows if calibrated else 0, cfg.seq_len, cfg.batch_size,
                        cfg.forward_dtype(stream.device), hessian=args.method in HESSIAN_METHODS or bool(args.refit),
                        refit=args.refit, true_sequential=cfg.true_sequential) if stream else None
    dense = {}
    if args.protect:
        c = model.cfg
        protected = read_protected(args.protect, list(model.layers), c.n_heads, "--protect")
        # a protected head's rows in a module --skip leaves dense are dense already: nothing to declare
        dense = {k: v for k, v in protected_rows(protected, c.n_heads, c.n_kv_heads, c.head_dim).items()
                 if k in targets}
    windows = cfg.windows(tokenizer) if calibrated else None
    settings = {
        "method": args.method, "pattern": str(pattern) if pattern else None, "sparsity": sparsity,
        "calibration": cfg.record(default_device()) if calibrated else None, "skip": list(skip),
        "blocksize": args.blocksize if args.method == "sparsegpt" else None,
        "percdamp": args.percdamp if args.method in HESSIAN_METHODS or args.refit else None,
        "refit": args.refit,
        "teacher": args.teacher, "eval": None, "protect": args.protect,
        "dense_rows": {k: int(v.sum()) for k, v in sorted(dense.items())}, "stream": need,
    }

    def prune(**kw):
        return prune_model(model, windows, args.method, sparsity, pattern, skip, args.blocksize, args.percdamp,
                           cfg, dense_rows=dense, refit=args.refit, **kw)

    with atomic_dir(out, overwrite=args.overwrite) as tmp:  # an error below leaves nothing behind
        # Masks leave block by block in both paths: held whole they were 0.1 GiB (SmolLM2) at the peak.
        masks_out = StreamedMasks(tmp, {n: tuple(model.get_submodule(n).weight.shape) for n in targets}, dense)
        if stream is None:
            with closed_at_end(masks_out):
                _, report = prune(write_masks=masks_out.write)
            save_hf(model, tmp, tokenizer=tokenizer)
        else:  # weights written block by block too
            with stream.writing(tmp, masks_out):
                _, report = prune(stream=stream, write_masks=masks_out.write)
            tokenizer.save_pretrained(str(tmp))
        windows = None  # the calibration's; freed before the evaluation
        print(_summary(args.method, report), file=sys.stderr)
        metrics = {k: report[k] for k in ("sparsity", "pruned_params", "total_params", "per_module", "timings_s",
                                          "refit") if k in report}
        metrics["peak_rss_gib"] = round(peak_rss_gib(), 3)  # this process: load + calibration (the eval runs apart)
        if (gpu := peak_device_memory_gib(default_device())) is not None:
            metrics["peak_gpu_memory_gib"] = round(gpu, 3)
        metrics["peak_rss_before_model_gib"] = round(before_model, 3)
        if args.eval:
            del model
            release_memory()
            ev = evaluate_dir(tmp, out, args.teacher, tmp / "eval.json", eval_cfg.cli_args())
            metrics["eval"], settings["eval"] = ev["buckets"], ev["settings"]
        write_manifest(tmp, stage="prune", settings=settings, metrics=metrics,
                       parent={"path": str(teacher_dir), "fingerprint": weights_fingerprint(teacher_dir)})
    print(out)


if __name__ == "__main__":
    run_cli(main)
