"""Local reconstruction of a pruned model's blocks: each block's MLP (gate, up and down projections), or all of its
linears, trained together on their kept weights (the masks never change) to match the teacher's block.

    python -m prune.reconstruct --artifact runs/smollm2/pruned-2of4 --out runs/smollm2/pruned-2of4-mlp

Why: SparseGPT and the layer refit (`prune.run --refit layer`) fit each linear alone to its own dense
output. Errors then add up through the SwiGLU nonlinearity and the down projection, which a per-matrix fit
cannot see; a fit of the whole MLP can (EBFT, Guo et al. 2024; "A Free Lunch in LLM Compression", Wagner
et al. 2025, find the per-matrix fit consistently worse and whole-submodule windows close to retraining
at a fraction of its data). The loss is ‖MLP(x) − y‖² / ‖y‖² (normalised MSE); each block keeps the epoch whose
held-out windows' NMSE was lowest, or its starting weights when none improved on them. What x and y are
(`--inputs`, fit_blocks):
- teacher (default): the dense teacher's MLP inputs and outputs; the blocks are independent;
- student: the pruned model's own MLP inputs, through its blocks as already fitted, onto the teacher's outputs
  (the fit sees the inputs it will get);
- block: the same inputs onto what makes the whole block output the teacher's (EBFT's objective with the MLP as
  the trained part: each block also corrects what the blocks before it left).

`--fit block` trains every linear of the block instead, attention's too (kept weights only where masked), on the
block's inputs (teacher's, or with --inputs block the pruned model's own) to output the teacher's block output:
EBFT's whole-block fit. Otherwise attention stays as pruned (the default recipe keeps it dense).
The maths and the block runner are core.block_fit's (qat.reconstruct fits a quantized model the same way); main()
is the lifecycle: fit block by block, write the artifact with the source's masks and side files.
"""
from __future__ import annotations

import shutil
import time
from dataclasses import asdict
from pathlib import Path

from core.artifact import parent_record, write_manifest
from core.block_fit import ReconstructConfig, add_fit_args, check_pair, fit_model, fit_settings, parse_blocks
from core.device import default_device, peak_rss_gib
from core.errors import ArgumentParser, SmeltError, run_cli
from core.files import atomic_dir
from core.masks import MASKS_FILE, load_masks
from models.hf_io import load_hf, load_tokenizer, save_hf
from models.teacher import DEFAULT_TEACHER, resolve_teacher


def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(prog="python -m prune.reconstruct", description=__doc__.split("\n")[0])
    ap.add_argument("--artifact", required=True, help="a pruned artifact (prune.run): HF directory + masks")
    ap.add_argument("--teacher", default=DEFAULT_TEACHER, help="the dense model whose blocks are matched")
    ap.add_argument("--out", required=True)
    ap.add_argument("--overwrite", action="store_true")
    add_fit_args(ap, ReconstructConfig)
    args = ap.parse_args(argv)
    cfg, calib = fit_settings(args, ReconstructConfig)
    src, out = Path(args.artifact), Path(args.out)
    if out.exists() and not args.overwrite:
        raise SmeltError(f"output directory {out} already exists (pass --overwrite to replace it)")
    if out.resolve() == src.resolve():
        raise SmeltError(f"--out {out} is the --artifact itself")
    masks = load_masks(src)
    if not masks:
        raise SmeltError(f"--artifact {src} has no {MASKS_FILE} (not a pruned artifact)")
    device = default_device()
    student = load_hf(src, device=str(device))
    teacher = load_hf(resolve_teacher(args.teacher), device=str(device)).eval()
    check_pair(teacher, student, args.teacher, src)
    blocks = parse_blocks(args.blocks, student, src)
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(src if (src / "tokenizer.json").is_file() else resolve_teacher(args.teacher))
    report = fit_model(teacher, student, masks, calib.windows(tokenizer), calib, cfg, blocks)
    del teacher
    for name, m in masks.items():  # the fit must not have revived a pruned weight
        if bool((student.get_submodule(name).weight.detach().cpu()[~m.cpu()] != 0).any()):
            raise SmeltError(f"{name}: a pruned weight is non-zero after the fit (a bug)")
    with atomic_dir(out, overwrite=args.overwrite) as tmp:
        for f in src.iterdir():  # masks, tokenizer, chat template: everything but the weights and the record
            if f.is_file() and f.name not in ("model.safetensors", "config.json", "manifest.json"):
                shutil.copy2(f, tmp / f.name)
        save_hf(student, tmp)
        write_manifest(tmp, stage="reconstruct",
                       settings={**asdict(cfg), "blocks": blocks, "teacher": args.teacher,
                                 "calibration": calib.record(device)},
                       metrics={"per_block": report, "seconds": round(time.perf_counter() - t0, 1),
                                "peak_rss_gib": round(peak_rss_gib(), 3)},
                       parent=parent_record(src))
    print(out)


if __name__ == "__main__":
    run_cli(main)
