"""Whole recipe chains that differ only in a calibration seed, grouped by setting: the release's KL per bucket and
its needle retrieval, every seed and each setting's mean and range, so that a setting is judged against the
scatter of its own seeds rather than against one chain.

    smelt chain-seeds --out results/bench/recipe-calib-settings/pruner-seeds \
        default=smollm2-gptqbf16:runs/A/evals/qat-2of4.json:needle400/A.json,... bf16=...

Each setting is LABEL=CHAIN,CHAIN,...; a chain is NAME:EVAL:NEEDLE, EVAL the release's eval.evaluate JSON and
NEEDLE its eval.needle grid. Writes OUT.json (every chain, and per setting the mean and min-max of each figure)
and OUT.png (needles against en KL mean, one marker per chain, one colour per setting).
"""
from __future__ import annotations

import json
import statistics

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from core.errors import ArgumentParser, SmeltError, run_cli
from core.files import atomic_path, atomic_write_text, read_json

BUCKETS = ("en", "zh", "code", "news")


def chain_figures(eval_path: str, needle_path: str) -> dict:
    buckets = read_json(eval_path, "an eval.evaluate result").get("buckets", {})
    missing = [b for b in BUCKETS if b not in buckets]
    if missing:
        raise SmeltError(f"settings: {eval_path} has no bucket {missing[0]!r}")
    needle = read_json(needle_path, "an eval.needle result").get("languages", {}).get("en")
    if not needle:
        raise SmeltError(f"settings: {needle_path} holds no English needle grid")
    out = {f"kl_mean_{b}": buckets[b]["kl_mean"] for b in BUCKETS}
    out |= {f"kl_p99_{b}": buckets[b]["kl_p99"] for b in BUCKETS}
    out |= {"ppl_en": buckets["en"]["ppl"], "needles_all": needle["accuracy"],
            "needles_2048": needle["by_length"]["2048"], "needle_prompts": len(needle["prompts"])}
    return out


def parse_setting(spec: str) -> tuple[str, dict[str, dict]]:
    label, _, chains = spec.partition("=")
    if not label or not chains:
        raise SmeltError(f"settings: {spec!r} is not LABEL=NAME:EVAL:NEEDLE,...")
    out = {}
    for chain in chains.split(","):
        parts = chain.split(":")
        if len(parts) != 3:
            raise SmeltError(f"settings: chain {chain!r} of {label} is not NAME:EVAL:NEEDLE")
        out[parts[0]] = chain_figures(parts[1], parts[2])
    return label, out


def summary(chains: dict[str, dict]) -> dict:
    keys = next(iter(chains.values())).keys()
    return {k: {"mean": statistics.fmean(c[k] for c in chains.values()),
                "min": min(c[k] for c in chains.values()), "max": max(c[k] for c in chains.values())}
            for k in keys if k != "needle_prompts"}


def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(prog="python -m eval.chain_seeds", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="path stem: OUT.json and OUT.png")
    ap.add_argument("settings", nargs="+", help="LABEL=NAME:EVAL:NEEDLE,NAME:EVAL:NEEDLE,...")
    args = ap.parse_args(argv)
    settings = dict(parse_setting(s) for s in args.settings)
    result = {"what": __doc__.split("\n\n")[0], "buckets": list(BUCKETS),
              "settings": {label: {"chains": chains, "summary": summary(chains)} for label, chains in settings.items()}}
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for label, chains in settings.items():
        for ax, key in zip(axes, ("needles_all", "needles_2048"), strict=True):
            xs = [100 * c[key] for c in chains.values()]
            ax.scatter(xs, [c["kl_mean_en"] for c in chains.values()], label=label, s=40)
            for name, x, c in zip(chains, xs, chains.values(), strict=True):
                ax.annotate(name, (x, c["kl_mean_en"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    for ax, title in zip(axes, ("all lengths", "2,048 tokens"), strict=True):
        ax.set_xlabel(f"needles retrieved, % ({title})")
        ax.set_ylabel("release KL mean to the teacher, en")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("Whole chains by calibration seed: retrieval scatters far more than KL", fontsize=10)
    fig.tight_layout()
    with atomic_path(f"{args.out}.png") as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    atomic_write_text(f"{args.out}.json", json.dumps(result, indent=1) + "\n")
    for label, s in result["settings"].items():
        m = s["summary"]
        print(f"{label:>10}: {len(s['chains'])} chains; needles {100 * m['needles_all']['min']:.1f}-"
              f"{100 * m['needles_all']['max']:.1f}% (mean {100 * m['needles_all']['mean']:.1f}); KL mean "
              + " / ".join(f"{b} {m[f'kl_mean_{b}']['mean']:.3f}" for b in BUCKETS))


if __name__ == "__main__":
    run_cli(main)
