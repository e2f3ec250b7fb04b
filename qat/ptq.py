"""Post-training weight quantization baselines, RTN and GPTQ, writing a quantized artifact.

    python -m qat.ptq --method gptq --group-size 64 --out runs/smollm2/gptq-w4g64 [--eval]
    python -m qat.ptq --method rtn --artifact runs/smollm2/pruned-2of4 --out runs/smollm2/rtn-2of4

The input is the teacher (default) or any artifact (a pruned one keeps its masks: GPTQ never revives a
removed weight). GPTQ's Hessians come from the calibration engine (core.calibrate.run_blocks), block by
block and sequentially (each block calibrated on the already-quantized blocks before it). The output is
the quantized artifact format of qat.qparams: dequantized weights + scales (+ masks) + manifest.
"""
from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch

from core.artifact import parent_record, write_manifest
from core.calibrate import (
    CalibConfig,
    add_precision_args,
    add_sampling_arg,
    calibration_device,
    run_blocks,
    shared_inputs,
)
from core.device import default_device, peak_device_memory_gib, peak_rss_gib, release_memory, synchronize
from core.errors import ArgumentParser, SmeltError, run_cli
from core.evaluation import evaluate_dir
from core.files import atomic_dir
from core.masks import MASKS_FILE, MasksOnDisk, load_dense_rows, load_masks, save_masks
from core.sidefiles import closed_at_end
from models.hf_io import load_hf, load_tokenizer, save_hf
from models.llama import DEFAULT_SKIP
from models.mtp import MTP_FILE
from models.streamed import StreamedModel, blocks_in_order, check_memory
from models.teacher import DEFAULT_TEACHER, resolve_teacher
from qat.fake_quant import quantized_linears
from qat.gptq import gptq_quantize
from qat.qparams import StreamedQparams, spec_to_dict
from qat.quantizers import QuantSpec, check_group, rtn


def quantize_model(model, method: str, spec: QuantSpec, masks: dict, windows: torch.Tensor | None,
                   calib: CalibConfig | None = None, blocksize: int = 128, percdamp: float = 0.01,
                   act_order: bool = False, skip: tuple[str, ...] = DEFAULT_SKIP, progress: bool = True,
                   stream: StreamedModel | None = None, write_qparams: Callable[[dict], None] | None = None):
    """Quantize the model's linears in place; returns ({name: (scale, zp)}, report).

    stream: the model is a StreamedModel's (meta until each block is loaded).
    write_qparams: each block's qparams go to it as soon as the block is done (streamed or not), the rest
    (linears outside the blocks) at the end, and the returned dict is empty."""
    names = quantized_linears(model, skip, field="--skip")
    outside = [n for n in names if not n.startswith("layers.")]
    if method == "gptq" and outside:  # it calibrates block by block: a linear outside would stay unquantized
        raise SmeltError(f"--skip: gptq calibrates the transformer blocks only; {outside[0]} is outside them "
                         "(add it to --skip, or quantize it with rtn)")
    if stream is not None and outside:
        raise SmeltError(f"--max-memory streams the transformer blocks only; {outside[0]} is outside them "
                         "(add it to --skip)")
    modules = dict(model.named_modules())
    for name in names:  # refuse before doing any work
        check_group(modules[name].in_features, spec.group_size, name)
    calib = calib or CalibConfig()
    if method == "gptq":
        calib.check_dampening(percdamp, calibration_device(model, stream))
    qparams: dict[str, tuple] = {}
    seconds = {"quantize_s": 0.0}

    def quantize_group(group: list[str], H: torch.Tensor | None) -> None:
        """One GPTQ sweep over the stacked rows of linears that share H (rows are independent given H:
        the same result as one sweep each, with one H inverse and a third of the column loops)."""
        lins = [modules[n] for n in group]
        t0 = time.perf_counter()
        W = torch.cat([lin.weight.data for lin in lins])
        keep = None
        if any(n in masks for n in group):
            keep = torch.cat([masks[n].to(W.device) if n in masks else torch.ones_like(lin.weight, dtype=torch.bool)
                              for n, lin in zip(group, lins, strict=True)])
        label = group[0] if len(group) == 1 else f"{group[0]} (+{len(group) - 1} sharing its input)"
        if method == "rtn":
            w_q, scale, zp = rtn(W * keep if keep is not None else W, spec, name=label)
        else:
            w_q, scale, zp = gptq_quantize(W, H, spec, blocksize=blocksize, percdamp=percdamp,
                                          act_order=act_order, mask=keep, name=label)
        sizes = [lin.out_features for lin in lins]
        parts = zip(group, lins, w_q.split(sizes), scale.split(sizes),
                    zp.split(sizes) if zp is not None else [None] * len(group), strict=True)
        for name, lin, wq_i, s_i, z_i in parts:
            lin.weight.data.copy_(wq_i.to(lin.weight.dtype))
            qparams[name] = (s_i.contiguous(), None if z_i is None else z_i.contiguous())
        synchronize()  # the sweep's queued GPU kernels are its time
        seconds["quantize_s"] += time.perf_counter() - t0

    def block_done(block_name: str) -> None:
        if write_qparams is not None:  # this block's qparams leave now, not at the end
            write_qparams({n: qparams.pop(n) for n in list(qparams) if n.startswith(block_name + ".")})

    if method == "rtn":  # block by block, its qparams leaving with it
        for prefix, _ in blocks_in_order(model, stream):
            for name in (n for n in names if n.startswith(prefix + ".")):
                quantize_group([name], None)
            block_done(prefix)
        for name in outside:
            quantize_group([name], None)
    elif method == "gptq":
        def on_block(block_name, block, stats):
            for group in shared_inputs(stats):
                quantize_group(group, stats[group[0]].H)
        seconds.update(run_blocks(model, windows, on_block, calib, targets=set(names),
                                  progress=progress, stream=stream, block_done=block_done))
    else:
        raise SmeltError(f"--method {method!r} is not one of rtn, gptq")
    if write_qparams is not None and qparams:  # linears outside the blocks come last in the file, as in names
        write_qparams(qparams)
        qparams = {}
    return qparams, {"modules": len(names), "seconds": seconds}


def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(prog="python -m qat.ptq", description="RTN / GPTQ weight quantization into a quantized artifact.")
    ap.add_argument("--teacher", default=DEFAULT_TEACHER)
    ap.add_argument("--artifact", help="quantize this artifact instead of the teacher (keeps its masks)")
    ap.add_argument("--method", required=True, choices=["rtn", "gptq"])
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=64, help="-1 for per output channel")
    ap.add_argument("--asym", action="store_true", help="asymmetric (zero points); not releasable")
    ap.add_argument("--scale-init", default="minmax", choices=["minmax", "mse"])
    ap.add_argument("--act-order", action="store_true")
    ap.add_argument("--blocksize", type=int, default=128)
    ap.add_argument("--percdamp", type=float, default=0.01)
    ap.add_argument("--calib-windows", type=int, default=128)
    ap.add_argument("--calib-seq-len", type=int, default=512)
    ap.add_argument("--calib-corpus", default=CalibConfig.corpus,
                    help="training corpus or a '+'-joined mix (wikitext2-valid+code-train+zh-train), a local "
                         "text/jsonl/parquet file or folder, or hf:<dataset>")
    add_sampling_arg(ap)
    ap.add_argument("--seed", type=int, default=0)
    add_precision_args(ap)
    ap.add_argument("--calib-true-sequential", action="store_true",
                    help="calibrate each group of a block's linears on inputs through the groups already quantized "
                         "(one forward per block; more activations held)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--overwrite", action="store_true")
    ap.add_argument("--skip", default=",".join(DEFAULT_SKIP),
                    help="modules left in full precision: full names, dotted prefixes ('layers.0') or "
                         "suffixes ('feed_forward.w2'), comma-separated")
    ap.add_argument("--max-memory", type=float, metavar="GIB",
                    help="stream the model: blocks read from the checkpoint one at a time and the artifact "
                         "written block by block, refused unless the calibration's estimated footprint fits GIB "
                         "(on a GPU: of GPU memory, and the GPU's free memory)")
    ap.add_argument("--eval", action="store_true", help="evaluate against the teacher into the manifest")
    args = ap.parse_args(argv)
    skip = tuple(s.strip() for s in args.skip.split(",") if s.strip())
    out = Path(args.out)
    if out.exists() and not args.overwrite:
        raise SmeltError(f"--out {out} already exists (pass --overwrite to replace it)")
    spec = QuantSpec(bits=args.bits, symmetric=not args.asym, group_size=args.group_size,
                     scale_init=args.scale_init)
    calib, windows = None, None
    if args.method == "gptq":  # validated before any weights load
        calib = CalibConfig(n_windows=args.calib_windows, seq_len=args.calib_seq_len, seed=args.seed,
                            corpus=args.calib_corpus, sampling=args.calib_sampling, forward=args.calib_forward,
                            hessian=args.calib_hessian, true_sequential=args.calib_true_sequential)
        calib.check_dampening(args.percdamp, default_device())
    teacher_dir = resolve_teacher(args.teacher)
    src = Path(args.artifact) if args.artifact else teacher_dir
    device = default_device()  # calibration on the GPU when one is present
    before_model = peak_rss_gib()  # interpreter, torch: what no --max-memory can cut
    stream = StreamedModel(src, device) if args.max_memory is not None else None
    model = stream.model if stream else load_hf(src, device=str(device))
    tokenizer = load_tokenizer(teacher_dir)
    masks = MasksOnDisk(src) if stream else load_masks(src)
    names = quantized_linears(model, skip, field="--skip")  # refuse a bad --skip before calibrating
    need = None
    if stream is not None:
        need = check_memory(stream, args.max_memory, calib.n_windows if calib else 0, args.calib_seq_len,
                            calib.batch_size if calib else 1,
                            calib.forward_dtype(device) if calib else torch.float32, hessian=calib is not None,
                            true_sequential=calib is not None and calib.true_sequential)
    if calib is not None:
        windows = calib.windows(tokenizer)

    def quantize(**kw):
        return quantize_model(model, args.method, spec, masks, windows, calib, args.blocksize, args.percdamp,
                              args.act_order, skip, **kw)

    with atomic_dir(out, overwrite=args.overwrite) as tmp:
        t0 = time.perf_counter()
        # qparams leave block by block in both paths, as prune.run's masks: one writer, nothing held past its
        # block (they are small: GPTQ's peak RSS did not move, results/bench/oneshot-gptq-qparams-streamed)
        qout = StreamedQparams(tmp, {n: tuple(model.get_submodule(n).weight.shape) for n in names}, spec)
        if stream is None:
            with closed_at_end(qout):
                _, report = quantize(write_qparams=qout.write)
        else:  # weights written block by block too
            with stream.writing(tmp, qout):
                _, report = quantize(stream=stream, write_qparams=qout.write)
        report["wall_s"] = time.perf_counter() - t0
        report["peak_rss_gib"] = round(peak_rss_gib(), 3)  # load + calibration (the eval runs apart)
        if (gpu := peak_device_memory_gib(device)) is not None:
            report["peak_gpu_memory_gib"] = round(gpu, 3)
        report["peak_rss_before_model_gib"] = round(before_model, 3)
        metrics = {"ptq": report}
        if stream is None:
            save_hf(model, tmp, tokenizer=tokenizer)
            if masks:
                save_masks(model, masks, tmp, load_dense_rows(src))
        else:
            tokenizer.save_pretrained(str(tmp))
            if masks:  # GPTQ never changes a mask, and a streamed model keeps its layer numbers
                shutil.copy2(src / MASKS_FILE, tmp / MASKS_FILE)
        if (src / MTP_FILE).is_file():  # carried through; its metadata names the model it was trained on
            shutil.copy2(src / MTP_FILE, tmp / MTP_FILE)
        if args.eval:
            del model
            release_memory()
            metrics["eval"] = evaluate_dir(tmp, out, args.teacher, tmp / "eval.json")
        write_manifest(tmp, stage="ptq", settings={
            "method": args.method, "spec": spec_to_dict(spec), "act_order": args.act_order,
            "blocksize": args.blocksize, "percdamp": args.percdamp, "source": str(src), "skip": list(skip),
            "calibration": calib.record(default_device()) if calib else None, "stream": need},
            metrics=metrics, parent=parent_record(src))
    print(f"wrote {out} ({report['modules']} modules, {report['wall_s']:.0f}s)")


if __name__ == "__main__":
    run_cli(main)
