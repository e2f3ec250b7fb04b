"""Sweep prune.reconstruct's lr and epochs on a few blocks, capturing the teacher's MLP inputs once.

    python scripts/reconstruct_sweep.py --artifact runs/smollm2-refit-default/pruned-2of4 --blocks 0,14,29 \
        --runs 3e-5:4,1e-4:4,3e-4:4 --out results/bench/reconstruct/lr-sweep-1.json

Each block's fit is exactly what `python -m prune.reconstruct --blocks ... --lr L --epochs E` does (same
windows, same seed); this only saves the repeated teacher forward.
"""
import argparse
import copy
import json
import sys
import time

from core.masks import load_masks
from models.hf_io import load_hf, load_tokenizer
from models.teacher import resolve_teacher
from prune.reconstruct import CALIB, ReconstructConfig, fit_blocks, part_masks, reconstruct_mlp

ap = argparse.ArgumentParser()
ap.add_argument("--artifact", required=True)
ap.add_argument("--teacher", default="smollm2-135m")
ap.add_argument("--blocks", default="0,14,29")
ap.add_argument("--runs", required=True, help="lr:epochs pairs, comma-separated")
ap.add_argument("--out", required=True)
args = ap.parse_args()
blocks = args.blocks.split(",")
runs = [(float(lr), int(ep)) for lr, ep in (r.split(":") for r in args.runs.split(","))]
student, masks = load_hf(args.artifact), load_masks(args.artifact)
teacher = load_hf(resolve_teacher(args.teacher)).eval()
calib = CALIB  # prune.reconstruct's defaults
t0 = time.perf_counter()
io = {}  # {block: the teacher's MLP inputs and outputs}: what --inputs teacher fits on
fit_blocks(teacher, student, calib.windows(load_tokenizer(args.artifact)), calib.batch_size, blocks, "teacher",
           lambda b, x, y: io.__setitem__(b, (x, y)))
res = {"capture_s": time.perf_counter() - t0}
for lr, epochs in runs:
    for b in blocks:
        mlp = copy.deepcopy(student.layers[b].feed_forward)
        t = time.perf_counter()
        r = reconstruct_mlp(mlp, part_masks(masks, b, "mlp"), *io[b], ReconstructConfig(epochs=epochs, lr=lr), calib.seq_len)
        res[f"lr{lr:g}-ep{epochs}/block{b}"] = {**r, "seconds": round(time.perf_counter() - t, 1)}
        print(lr, epochs, b, r["before"]["heldout"], "->", r["after"]["heldout"], file=sys.stderr, flush=True)
with open(args.out, "w") as f:
    json.dump({"artifact": args.artifact, "command": "python " + " ".join(sys.argv), "results": res}, f, indent=1)
