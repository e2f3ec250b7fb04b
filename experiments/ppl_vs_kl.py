"""How a bucket's PPL ratio to the teacher follows its KL mean, over many evaluations of compressed models.

    python experiments/ppl_vs_kl.py --out results/reconstruct/ppl-vs-kl results/reconstruct

Why: a target can be set on both (release en PPL <= 1.35x the teacher's, KL mean <= 0.45), and one chain's en PPL
did not move while its KL fell. The log PPL ratio is the student's cross-entropy minus the teacher's on the text,
which equals the KL only where the text is drawn from the teacher; this measures how close it is here. Per
bucket: a least-squares line through the origin, log(ppl / teacher_ppl) = slope * kl_mean, its correlation, and
the KL mean at which that line reaches a PPL ratio of 1.35. Writes <out>.json and <out>.png.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from core.data import BUCKETS  # the evaluation's buckets, in its order

TARGET_RATIO = 1.35


def points(folders: list[Path]) -> dict[str, list[tuple[float, float, str]]]:
    """{bucket: [(kl_mean, log ppl ratio, file)]} from every eval.evaluate JSON in the folders."""
    out: dict[str, list] = {b: [] for b in BUCKETS}
    for folder in folders:
        for f in sorted(folder.glob("*.json")):
            buckets = json.loads(f.read_text()).get("buckets")
            if not isinstance(buckets, dict):
                continue  # not an evaluation
            for b in BUCKETS:
                v = buckets.get(b)
                if isinstance(v, dict) and v.get("teacher_ppl"):
                    out[b].append((v["kl_mean"], math.log(v["ppl"] / v["teacher_ppl"]), f.name))
    return out


def fit(pts: list[tuple[float, float, str]]) -> dict:
    kl = [p[0] for p in pts]
    gap = [p[1] for p in pts]
    slope = sum(k * g for k, g in zip(kl, gap)) / sum(k * k for k in kl)
    corr = statistics.correlation(kl, gap)
    resid = [g - slope * k for k, g in zip(kl, gap)]
    return {"n": len(pts), "slope": slope, "corr": corr,
            "resid_sd": math.sqrt(sum(r * r for r in resid) / max(1, len(resid) - 1)),
            "kl_mean_at_target_ratio": math.log(TARGET_RATIO) / slope}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="output path without suffix (.json and .png are written)")
    ap.add_argument("folders", nargs="+", type=Path, help="folders of eval.evaluate JSON")
    args = ap.parse_args()
    pts = points(args.folders)
    if not any(pts.values()):
        ap.error("no evaluation JSON (with a 'buckets' table) in the folders given")
    result = {"target_ratio": TARGET_RATIO, "folders": [str(f) for f in args.folders],
              "buckets": {b: {**fit(p), "points": p} for b, p in pts.items() if len(p) >= 3}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    fig, axes = plt.subplots(1, len(result["buckets"]), figsize=(4 * len(result["buckets"]), 3.6))
    for ax, (b, r) in zip(axes, result["buckets"].items()):
        kl = [p[0] for p in r["points"]]
        ax.scatter(kl, [math.exp(p[1]) for p in r["points"]], s=12)
        xs = [max(kl) * 1.05 * i / 50 for i in range(51)]  # the line is exp(slope * kl) in PPL ratio
        ax.plot(xs, [math.exp(r["slope"] * x) for x in xs], lw=1, label=f"slope {r['slope']:.2f}, r {r['corr']:.3f}")
        ax.axhline(TARGET_RATIO, color="grey", ls=":", lw=1)
        ax.set(title=b, xlabel="KL mean to the teacher", ylabel="PPL / teacher PPL")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    for b, r in result["buckets"].items():
        print(f"{b}: n {r['n']}  slope {r['slope']:.3f}  r {r['corr']:.3f}  residual sd {r['resid_sd']:.3f}  "
              f"KL mean at {TARGET_RATIO}x PPL: {r['kl_mean_at_target_ratio']:.3f}")


if __name__ == "__main__":
    main()
