"""How SparseGPT 2:4 calibration scales on this machine, and what that predicts for 8B and 70B teachers.

    .venv/bin/python experiments/bench_scaling.py --runs runs/scaling --out results/bench/scaling \
        [--windows 32,64,128,256] [--layers 10,20,30] [--forward bfloat16]

Each point is the real stage (`prune.run --method sparsegpt --pattern 2:4 --max-memory ...`, streamed)
as its own process: the windows sweep on the whole teacher, the layers sweep at 128 windows on copies
of the teacher cut to its first L blocks. Written: OUT/summary.json (every point's time split and peak
RSS, a least-squares fit of time against windows x layers, and the estimate) and OUT/scaling.png.

The 8B / 70B figures are an ESTIMATE, not a measurement: each phase's seconds per block on SmolLM2 are
scaled by that phase's operation count for the bigger block (forward: matmul FLOPs per token; XᵀX: tokens
x in²; inverses: in³; the SparseGPT sweep: rows x in²), which is what this CPU would take; for one H100
the same operation counts are divided by the sustained rates stated in H100_RATES (assumptions, listed in
the JSON), not by anything measured: a lower bound, since the sweeps' per-column Python steps and the
transfers are not counted.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from models.llama import LlamaConfig
from models.streamed import block_params, footprint, linear_groups

MIX = "wikitext2-valid+code-train+zh-train"
SEQ = 512
BIG = {  # Llama-3.1 shapes (their config.json), calibrated at the usual 128 x 2048 windows
    "llama3.1-8b": LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336, vocab_size=128256),
    "llama3.1-70b": LlamaConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden=28672,
                                vocab_size=128256),
}
BIG_WINDOWS, BIG_SEQ = 128, 2048
# Assumed sustained H100 rates (FLOP/s), not measured here: bf16 dense matmul at ~45% of the 989 TFLOP/s
# peak; fp32 XᵀX and sweeps on TF32 tensor cores at ~30% of 495; Cholesky-based inverses ~10 TFLOP/s.
H100_RATES = {"forward_s": 450e12, "stats_s": 150e12, "prune_update_s": 150e12, "hessian_inverse_s": 10e12}


def ops(cfg: LlamaConfig, tokens: int, seq: int) -> dict[str, float]:
    """Operation counts of one block's calibration, by phase (the same phases the stage's manifest times)."""
    groups = linear_groups(cfg)
    matmul = 2 * sum(i * r for i, r in groups) + 4 * seq * cfg.n_heads * cfg.head_dim  # per token, with attention
    return {"forward_s": 2 * tokens * matmul,  # the statistics pass and the pruned-output pass
            "stats_s": 2 * tokens * sum(i * i for i, _ in groups),
            "hessian_inverse_s": sum(i ** 3 for i, _ in groups),
            "prune_update_s": 2 * sum(r * i * i for i, r in groups)}


def cut_teacher(teacher: Path, layers: int, out: Path) -> Path:
    """The teacher's first `layers` blocks, embedding and head, as an HF directory."""
    if (out / "config.json").is_file():
        return out
    from torch import nn

    from models.hf_io import load_hf, load_tokenizer, save_hf

    model = load_hf(teacher)
    model.layers = nn.ModuleDict({k: v for k, v in model.layers.items() if int(k) < layers})
    out.mkdir(parents=True, exist_ok=True)
    save_hf(model, out, tokenizer=load_tokenizer(teacher))
    return out


def run_point(teacher: Path, windows: int, out: Path, forward: str, limit: float) -> dict:
    cmd = [sys.executable, "-m", "prune.run", "--teacher", str(teacher), "--method", "sparsegpt", "--pattern", "2:4",
           "--calib-corpus", MIX, "--calib-windows", str(windows), "--calib-seq-len", str(SEQ),
           "--calib-forward", forward, "--max-memory", str(limit), "--out", str(out), "--overwrite"]
    subprocess.run(cmd, cwd=ROOT, check=True)
    m = json.loads((out / "manifest.json").read_text())
    return {"windows": windows, "layers": json.loads((teacher / "config.json").read_text())["num_hidden_layers"],
            "timings_s": m["metrics"]["timings_s"], "peak_rss_gib": m["metrics"]["peak_rss_gib"],
            "peak_rss_before_model_gib": m["metrics"]["peak_rss_before_model_gib"],
            "footprint_gib": m["settings"]["stream"]["footprint_gib"]["total"]}


def fit(points: list[dict]) -> dict:
    """total_s ≈ a * windows * layers + c * layers (least squares, no intercept): a per-token-per-block cost
    (forwards, XᵀX) and a per-block cost that no window count changes (inverses, sweeps); with each
    point's relative residual."""
    xs = [(p["windows"] * p["layers"], p["layers"]) for p in points]
    ys = [p["timings_s"]["total_s"] for p in points]
    s11 = sum(x * x for x, _ in xs)
    s12 = sum(x * z for x, z in xs)
    s22 = sum(z * z for _, z in xs)
    t1 = sum(x * y for (x, _), y in zip(xs, ys))
    t2 = sum(z * y for (_, z), y in zip(xs, ys))
    det = s11 * s22 - s12 * s12
    a, c = (t1 * s22 - t2 * s12) / det, (s11 * t2 - s12 * t1) / det
    return {"s_per_window_per_layer": a, "s_per_layer": c,
            "residuals": [round((y - (a * x + c * z)) / y, 4) for (x, z), y in zip(xs, ys)], "n": len(xs)}


def estimate(ref: dict, cfg_small: LlamaConfig) -> dict:
    """Per phase: SmolLM2's measured seconds per block, scaled by operation counts (this CPU), and the
    operation counts at the assumed H100 rates."""
    tokens = ref["windows"] * SEQ
    small = ops(cfg_small, tokens, SEQ)
    per_block = {k: ref["timings_s"][k] / ref["layers"] for k in small}
    out = {}
    for name, cfg in BIG.items():
        big = ops(cfg, BIG_WINDOWS * BIG_SEQ, BIG_SEQ)
        cpu = sum(per_block[k] * big[k] / small[k] for k in big) * cfg.n_layers
        gpu = sum(big[k] / H100_RATES[k] for k in big) * cfg.n_layers
        fp = footprint(cfg, BIG_WINDOWS, BIG_SEQ, 8, 2, hessian=True)
        out[name] = {"windows": f"{BIG_WINDOWS} x {BIG_SEQ}", "this_cpu_hours_estimate": round(cpu / 3600, 1),
                     "h100_minutes_estimate": round(gpu / 60, 1),
                     "streamed_footprint_gib": round(fp["total"] / 2**30, 1),
                     "fp32_weights_gib": round(4 * (cfg.n_layers * block_params(cfg) + cfg.vocab_size * cfg.dim * 2)
                                               / 2**30, 1)}
    return {"assumed_h100_flops": H100_RATES, "models": out}


def plot(points: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for p in points:
        x = p["windows"] * p["layers"]
        ax1.scatter(x, p["timings_s"]["total_s"], color="C0" if p["layers"] == 30 else "C1")
        ax2.scatter(x, p["peak_rss_gib"], color="C0" if p["layers"] == 30 else "C1")
        ax2.scatter(x, p["peak_rss_before_model_gib"], color="grey", marker="x")
    ax1.set(xlabel="windows x layers", ylabel="calibration seconds", title="SparseGPT 2:4, streamed (blue: 30 layers)")
    ax2.set(xlabel="windows x layers", ylabel="GiB", title="peak RSS (x: before the model)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--teacher", default=None, help="HF directory (default: the registered SmolLM2 teacher)")
    ap.add_argument("--windows", default="32,64,128,256")
    ap.add_argument("--layers", default="10,20,30")
    ap.add_argument("--forward", default="bfloat16", help="--calib-forward of every point (the recipe's)")
    ap.add_argument("--max-memory", type=float, default=1.0, help="--max-memory of every point (GiB)")
    ap.add_argument("--reanalyse", action="store_true", help="refit and re-estimate OUT/summary.json's points")
    args = ap.parse_args()
    from models.hf_io import config_from_hf, read_hf_config
    from models.teacher import resolve_teacher

    teacher = Path(args.teacher) if args.teacher else resolve_teacher("smollm2-135m")
    cfg = config_from_hf(read_hf_config(teacher))
    if args.reanalyse:
        summary = json.loads((args.out / "summary.json").read_text())
        points = summary["points"]
    else:
        points = []
        for w in (int(x) for x in args.windows.split(",")):
            points.append(run_point(teacher, w, args.runs / f"w{w}-l{cfg.n_layers}", args.forward, args.max_memory))
        for L in (int(x) for x in args.layers.split(",")):
            if L != cfg.n_layers:
                cut = cut_teacher(teacher, L, args.runs / f"teacher-l{L}")
                points.append(run_point(cut, 128, args.runs / f"w128-l{L}", args.forward, args.max_memory))
        summary = {"command": " ".join(sys.argv), "seq_len": SEQ, "forward": args.forward, "points": points}
    ref = next(p for p in points if p["windows"] == 128 and p["layers"] == cfg.n_layers)
    summary.update(fit=fit(points), estimate=estimate(ref, cfg))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot(points, args.out / "scaling.png")
    print(json.dumps({k: summary[k] for k in ("fit", "estimate")}, indent=1))


if __name__ == "__main__":
    main()
