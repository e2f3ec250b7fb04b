"""How far a fit moved a quantized artifact: per linear kind, the share of kept weights whose integer code changed
and the mean relative change of the group scales, between two artifacts on the same grid (qat.qparams format).

    python experiments/code_changes.py runs/smollm2-qathi/gptq-2of4 runs/qrecon/gptq-2of4-fit --json out.json
"""
import argparse
import json
from collections import defaultdict

import torch

from core.masks import load_masks
from models.hf_io import load_hf
from qat.qparams import read_qparams
from qat.quantizers import quantize

ap = argparse.ArgumentParser()
ap.add_argument("before")
ap.add_argument("after")
ap.add_argument("--json")
args = ap.parse_args()
(q0, spec), (q1, spec1) = read_qparams(args.before), read_qparams(args.after)
assert spec == spec1 and q0.keys() == q1.keys()
w0, w1 = load_hf(args.before).state_dict(), load_hf(args.after).state_dict()
masks = load_masks(args.after)
acc = defaultdict(lambda: [0, 0, 0.0, 0])  # changed codes, kept weights, sum |Δs|/s, groups
for name in q0:
    c0 = quantize(w0[name + ".weight"].float(), q0[name][0], q0[name][1], spec)
    c1 = quantize(w1[name + ".weight"].float(), q1[name][0], q1[name][1], spec)
    keep = masks.get(name, torch.ones_like(c0, dtype=torch.bool))
    kind = name.split(".", 2)[-1]
    a = acc[kind]
    a[0] += int((c0 != c1)[keep].sum())
    a[1] += int(keep.sum())
    a[2] += float(((q1[name][0] - q0[name][0]).abs() / q0[name][0]).sum())
    a[3] += q0[name][0].numel()
res = {k: {"codes_changed": round(a[0] / a[1], 4), "scale_rel_change_mean": round(a[2] / a[3], 4)}
       for k, a in sorted(acc.items())}
print(json.dumps(res, indent=1))
if args.json:
    with open(args.json, "w") as f:
        json.dump({"before": args.before, "after": args.after, "per_kind": res}, f, indent=1)
