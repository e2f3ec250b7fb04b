"""Sweep a block fit's lrs and epochs on a few blocks, capturing the teacher's MLP inputs once.

    python experiments/reconstruct_sweep.py --artifact runs/smollm2-refit-default/pruned-2of4 --blocks 0,14,29 \
        --runs 3e-5:4,1e-4:4,3e-4:4 --out results/bench/reconstruct/lr-sweep-1.json
    python experiments/reconstruct_sweep.py --artifact runs/smollm2-recon/gptq-2of4 --runs 1e-4:4:1e-4 --out ...

A pruned artifact's fit is exactly what `python -m prune.reconstruct --blocks ... --lr L --epochs E` does (same
windows, same seed); a quantized one's (it has qparams.safetensors) what `python -m qat.reconstruct --inputs teacher
--lr L --epochs E --scale-lr S` does (runs lr:epochs:scale_lr). This only saves the repeated teacher forward.
"""
import argparse
import copy
import json
import sys
import time
from pathlib import Path

from core.block_fit import CALIB, ReconstructConfig, fit_blocks, part_masks, reconstruct_mlp
from core.masks import load_masks
from models.hf_io import load_hf, load_tokenizer
from models.teacher import resolve_teacher
from qat.qparams import QPARAMS_FILE, read_qparams
from qat.reconstruct import QuantReconstructConfig, to_fake_quant

ap = argparse.ArgumentParser()
ap.add_argument("--artifact", required=True)
ap.add_argument("--teacher", default="smollm2-135m")
ap.add_argument("--blocks", default="0,14,29")
ap.add_argument("--runs", required=True, help="lr:epochs (quantized: lr:epochs:scale_lr) triples, comma-separated")
ap.add_argument("--out", required=True)
args = ap.parse_args()
blocks = args.blocks.split(",")
runs = [[float(v) if i != 1 else int(v) for i, v in enumerate(r.split(":"))] for r in args.runs.split(",")]
student, masks = load_hf(args.artifact), load_masks(args.artifact)
quantized = (Path(args.artifact) / QPARAMS_FILE).is_file()
if quantized:
    to_fake_quant(student, *read_qparams(args.artifact))
teacher = load_hf(resolve_teacher(args.teacher)).eval()
calib = CALIB  # the stages' defaults
t0 = time.perf_counter()
io = {}  # {block: the teacher's MLP inputs and outputs}: what --inputs teacher fits on
fit_blocks(teacher, student, calib.windows(load_tokenizer(args.artifact)), calib.batch_size, blocks, "teacher",
           lambda b, x, y: io.__setitem__(b, (x, y)))
res = {"capture_s": time.perf_counter() - t0}
for lr, epochs, *scale_lr in runs:
    cfg = (QuantReconstructConfig(epochs=epochs, lr=lr, scale_lr=scale_lr[0], inputs="teacher") if quantized
           else ReconstructConfig(epochs=epochs, lr=lr))
    label = f"lr{lr:g}-ep{epochs}" + (f"-slr{scale_lr[0]:g}" if quantized else "")
    for b in blocks:
        mlp = copy.deepcopy(student.layers[b].feed_forward)
        t = time.perf_counter()
        r = reconstruct_mlp(mlp, part_masks(masks, b, "mlp"), *io[b], cfg, calib.seq_len)
        res[f"{label}/block{b}"] = {**r, "seconds": round(time.perf_counter() - t, 1)}
        print(label, b, r["before"]["heldout"], "->", r["after"]["heldout"], file=sys.stderr, flush=True)
with open(args.out, "w") as f:
    json.dump({"artifact": args.artifact, "command": "python " + " ".join(sys.argv), "results": res}, f, indent=1)
