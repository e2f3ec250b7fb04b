"""Where a bucket's KL tail sits: which tokens make a model's per-token KL P99, and whether they stay the same.

    smelt kl-tail --bucket en --out results/bench/kl-tail/en \\
        runs/smollm2/pruned-2of4 runs/smollm2/recovered-2of4 runs/smollm2/qat-2of4
    python -m eval.kl_tail ...                                   # the same

The P99 of the per-token KL moves far less than its mean under pruning, recovery and QAT; this says which tokens
make it. For each model, over the evaluation's windows (eval.evaluate's, the teacher's cached log-probs), the
tokens at or above its P99 are described by: their share of the KL (mass), the window positions they sit at (a
tail of short-context tokens would be the windows' doing, not the model's), how sure the teacher was (its top-1
probability), how often the model's top-1 differs there, how many could be copied from earlier in the window
(the bigram seen before: induction's work, which 2:4 pruning of attention could break), the next tokens most
often in it, and how much of each model's tail is also the first model's (a tail that persists from the one-shot
model through recovery and QAT is text the 2:4 model lost, not noise the training could average away). Writes
<out>.json and <out>.png.
"""
from __future__ import annotations

import functools
import json
import sys
from collections import Counter
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from safetensors import safe_open

from core.data import eval_windows
from core.device import default_device
from core.errors import ArgumentParser, SmeltError, run_cli
from core.files import atomic_write_text
from eval.evaluate import teacher_logprobs_file, token_stats
from models.hf_io import load_hf, load_tokenizer
from models.teacher import DEFAULT_TEACHER, resolve_teacher

# Window positions (0 = the prediction right after BOS), in bands of growing context.
BANDS = ((0, 16), (16, 64), (64, 256), (256, 1 << 30))
CONFIDENT = 0.5  # the teacher's top-1 probability above which it "knew" the next token


def copyable(windows: torch.Tensor) -> torch.Tensor:
    """bool [windows x (seq_len - 1)]: the next token continues a bigram seen earlier in its window (the pair
    (current, next) occurred before): what an induction head can copy rather than the weights must know."""
    out = torch.zeros(windows.shape[0], windows.shape[1] - 1, dtype=torch.bool)
    for w, ids in enumerate(windows.tolist()):
        seen = set()
        for i in range(len(ids) - 1):
            pair = (ids[i], ids[i + 1])
            out[w, i] = pair in seen
            seen.add(pair)
    return out.flatten()


def anatomy(kl: torch.Tensor, pos: torch.Tensor, teacher_maxp: torch.Tensor, agree: torch.Tensor,
            copy: torch.Tensor, q: float = 0.99) -> dict:
    """The tail (kl >= its q-quantile) against all tokens. All inputs [N]; pos: window position of each token;
    copy: whether the token is copyable from earlier in its window (copyable())."""
    thr = torch.quantile(kl.double(), q).item()
    tail = kl >= thr
    out = {"threshold": thr, "tokens": int(kl.numel()), "tail_tokens": int(tail.sum()),
           "kl_mean": kl.double().mean().item(),
           "tail_mass_share": (kl[tail].double().sum() / kl.double().sum()).item(),
           "copyable": {"all": copy.double().mean().item(), "tail": copy[tail].double().mean().item(),
                        "kl_mean_copyable": kl[copy].double().mean().item() if copy.any() else None},
           "teacher_confident": {"all": (teacher_maxp >= CONFIDENT).double().mean().item(),
                                 "tail": (teacher_maxp[tail] >= CONFIDENT).double().mean().item()},
           "top1_disagree": {"all": (~agree).double().mean().item(), "tail": (~agree[tail]).double().mean().item()},
           "bands": []}
    for lo, hi in BANDS:
        band = (pos >= lo) & (pos < hi)
        if band.any():
            out["bands"].append({"positions": [lo, min(hi, int(pos.max()) + 1)],
                                 "token_share": band.double().mean().item(),
                                 "tail_share": (band & tail).double().sum().item() / max(int(tail.sum()), 1),
                                 "kl_mean": kl[band].double().mean().item()})
    return out


def tail_overlap(first: torch.Tensor, other: torch.Tensor) -> float:
    """Share of `other`'s tail tokens (bool [N]) that are in `first`'s tail too."""
    return (first & other).double().sum().item() / max(int(other.sum()), 1)


def _teacher_maxp(lp_path: Path, n_windows: int, batch: int) -> torch.Tensor:
    """The teacher's top-1 probability per token, from its cached log-probs."""
    maxp = []
    with safe_open(str(lp_path), framework="pt") as f:
        sl = f.get_slice("logprobs")
        for s in range(0, n_windows, batch):
            lp = sl[s:s + batch].float()
            lp = lp - torch.logsumexp(lp, dim=-1, keepdim=True)
            maxp.append(lp.max(-1).values.exp().flatten())
    return torch.cat(maxp)


def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(prog="python -m eval.kl_tail", description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="+", type=Path, help="HF model directories; the first is the overlap's reference")
    ap.add_argument("--teacher", default=DEFAULT_TEACHER)
    ap.add_argument("--bucket", default="en")
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--top", type=int, default=15, help="next tokens listed from each tail")
    ap.add_argument("--out", type=Path, required=True, help="writes <out>.json and <out>.png")
    args = ap.parse_args(argv)
    for flag, value, low in (("--windows", args.windows, 1), ("--seq-len", args.seq_len, 2),
                             ("--batch-size", args.batch_size, 1), ("--top", args.top, 0)):
        if value < low:
            raise SmeltError(f"{flag}={value} must be >= {low}")
    for d in args.models:
        if not (d / "model.safetensors").is_file():
            raise SmeltError(f"models: {d} has no model.safetensors")
    teacher_dir = resolve_teacher(args.teacher)
    tok = load_tokenizer(teacher_dir)
    windows = eval_windows(tok, args.bucket, args.windows, args.seq_len)
    get_teacher = functools.cache(lambda: load_hf(teacher_dir).to(default_device()).eval())
    lp_path = teacher_logprobs_file(teacher_dir, windows, get_teacher, args.batch_size, desc=args.bucket)
    maxp = _teacher_maxp(lp_path, len(windows), args.batch_size)
    targets = windows[:, 1:].flatten()
    pos = torch.arange(windows.shape[1] - 1).repeat(len(windows))
    copy = copyable(windows)

    report = {"bucket": args.bucket, "windows": len(windows), "seq_len": args.seq_len, "teacher": str(teacher_dir),
              "command": " ".join(["python -m eval.kl_tail", *(sys.argv[1:] if argv is None else argv)]), "models": {}}
    tails = {}
    for d in args.models:
        model = load_hf(d).to(default_device()).eval()
        st = token_stats(model, windows, lp_path, args.batch_size, default_device(), desc=str(d))
        kl = st["kl"]
        r = anatomy(kl, pos, maxp, st["top1_agree"], copy)
        tails[d] = kl >= r["threshold"]
        r["top_next_tokens"] = [[tok.decode([t]), c] for t, c in
                                Counter(targets[tails[d]].tolist()).most_common(args.top)]
        r["in_first_models_tail"] = tail_overlap(tails[args.models[0]], tails[d])
        report["models"][str(d)] = r
        print(f"{d}: P99 {r['threshold']:.3f}, tail {r['tail_mass_share']:.0%} of the KL; teacher sure "
              f"{r['teacher_confident']['tail']:.0%} (all {r['teacher_confident']['all']:.0%}); top-1 differs "
              f"{r['top1_disagree']['tail']:.0%}; copyable {r['copyable']['tail']:.0%} (all "
              f"{r['copyable']['all']:.0%}); in the first model's tail {r['in_first_models_tail']:.0%}")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out.with_suffix(".json"), json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    _plot(report, args.out.with_suffix(".png"))


def _label(name: str) -> str:
    return "/".join(Path(name).parts[-2:])  # run folder and artifact: "qat-2of4" alone is ambiguous


def _grouped(ax, groups: list[str], series: list[tuple[str, list[float], str | None]]) -> None:
    width = 0.8 / len(series)
    for i, (label, values, color) in enumerate(series):
        ax.bar([x - 0.4 + width * (i + 0.5) for x in range(len(groups))], values, width, label=label, color=color)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel("share of tokens")
    ax.legend(fontsize=7)


def _plot(report: dict, path: Path) -> None:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.4))
    names, models = list(report["models"]), report["models"]
    first = models[names[0]]
    tails = [(f"P99 tail: {_label(n)} (P99 {models[n]['threshold']:.2f})", models[n], None) for n in names]
    _grouped(ax1, [f"{b['positions'][0]}-{b['positions'][1] - 1}" for b in first["bands"]],
             [("all tokens", [b["token_share"] for b in first["bands"]], "grey")]
             + [(lab, [b["tail_share"] for b in r["bands"]], c) for lab, r, c in tails])
    ax1.set_xlabel("window position")
    _grouped(ax2, ["teacher's top-1 p >= 0.5", "next token copyable\n(bigram earlier in window)",
                   f"in {_label(names[0])}'s tail"],
             [("all tokens", [first["teacher_confident"]["all"], first["copyable"]["all"],
                              first["tail_tokens"] / first["tokens"]], "grey")]
             + [(lab, [r["teacher_confident"]["tail"], r["copyable"]["tail"], r["in_first_models_tail"]], c)
                for lab, r, c in tails])
    fig.suptitle(f"{report['bucket']}: the tokens at or above each model's KL P99 ({report['windows']} x "
                 f"{report['seq_len']} windows)")
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    tmp.replace(path)

if __name__ == "__main__":
    run_cli(main)
