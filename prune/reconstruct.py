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

import time
from pathlib import Path

from core import block_fit
from core.artifact import parent_record, write_manifest
from core.device import default_device, peak_rss_gib
from core.errors import SmeltError, run_cli
from core.files import atomic_dir
from core.masks import MASKS_FILE, load_masks
from models.hf_io import load_hf, load_tokenizer, save_hf
from models.teacher import DEFAULT_TEACHER, resolve_teacher


def main(argv: list[str] | None = None) -> None:
    ap = block_fit.fit_parser("python -m prune.reconstruct", __doc__.split("\n")[0],
                              "a pruned artifact (prune.run): HF directory + masks", DEFAULT_TEACHER,
                              block_fit.ReconstructConfig)
    args = ap.parse_args(argv)
    cfg, calib = block_fit.fit_settings(args, block_fit.ReconstructConfig)
    src, out = Path(args.artifact), Path(args.out)
    block_fit.check_paths(src, out, args.overwrite)
    masks = load_masks(src)
    if not masks:
        raise SmeltError(f"--artifact {src} has no {MASKS_FILE} (not a pruned artifact)")
    device = default_device()
    student = load_hf(src, device=str(device))
    teacher = load_hf(resolve_teacher(args.teacher), device=str(device)).eval()
    block_fit.check_pair(teacher, student, args.teacher, src)
    blocks = block_fit.parse_blocks(args.blocks, student, src)
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(src if (src / "tokenizer.json").is_file() else resolve_teacher(args.teacher))
    report = block_fit.fit_model(teacher, student, masks, calib.windows(tokenizer), calib, cfg, blocks)
    del teacher
    block_fit.check_masks_kept(student, masks)
    with atomic_dir(out, overwrite=args.overwrite) as tmp:
        block_fit.copy_side_files(src, tmp, ())
        save_hf(student, tmp)
        settings, metrics = block_fit.fit_record(cfg, calib, device, blocks, args.teacher, report,
                                                 time.perf_counter() - t0, peak_rss_gib())
        write_manifest(tmp, stage="reconstruct", settings=settings, metrics=metrics, parent=parent_record(src))
    print(out)


if __name__ == "__main__":
    run_cli(main)
