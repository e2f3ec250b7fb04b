"""The bf16 forward copy against a whole-bf16 copy of each block, on the real teacher: all blocks run on the
same calibration windows in fp32 (the reference), as a whole-bf16 copy (residual stream in bf16) and as
core.forward_copy (linears bf16, residual stream and norms fp32); the last hidden state's relative error and
the logits' KL to the fp32 run, and the block time, interleaved over repeats (the median is reported).

    python experiments/probe_forward_copy.py --windows 16 --repeats 2 --out results/bench/forward-copy/probe.json
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from core.calibrate import CalibConfig
from core.forward_copy import forward_copy
from models.hf_io import load_hf, load_tokenizer
from models.teacher import resolve_teacher

MIX = "wikitext2-valid+code-train+zh-train"


@torch.no_grad()
def run(model, batches, cos, sin, mode: str) -> tuple[float, list[torch.Tensor]]:
    """Block time (s) and each batch's last hidden state, for one way of running the blocks."""
    seconds = 0.0
    hs = [model.tok_embeddings(b) for b in batches]
    if mode == "whole_bf16":
        hs = [h.bfloat16() for h in hs]
    for block in model.layers.values():
        fwd = {"fp32": block, "whole_bf16": None, "forward_copy": None}[mode]
        if mode == "whole_bf16":
            fwd = copy.deepcopy(block).bfloat16()
        elif mode == "forward_copy":
            fwd = forward_copy(block, torch.bfloat16)
        t0 = time.perf_counter()
        hs = [fwd(h, cos, sin) for h in hs]
        seconds += time.perf_counter() - t0
    return seconds, [h.float() for h in hs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    teacher = resolve_teacher("smollm2-135m")
    model = load_hf(teacher).eval()
    cfg = CalibConfig(n_windows=args.windows, corpus=MIX)
    windows = cfg.windows(load_tokenizer(teacher))
    cos, sin = model.rope_cos[:cfg.seq_len], model.rope_sin[:cfg.seq_len]
    batches = list(windows.split(cfg.batch_size))
    modes = ("fp32", "whole_bf16", "forward_copy")
    times: dict[str, list[float]] = {m: [] for m in modes}
    last: dict[str, list[torch.Tensor]] = {}
    for _ in range(args.repeats):
        for m in modes:
            t, last[m] = run(model, batches, cos, sin, m)
            times[m].append(t)
    result = {"windows": args.windows, "seq_len": cfg.seq_len, "corpus": MIX, "repeats": args.repeats,
              "threads": torch.get_num_threads(), "modes": {}}
    with torch.no_grad():
        ref_logp = [F.log_softmax(model.output(model.norm(h)), -1) for h in last["fp32"]]
        for m in modes:
            err = [float((h - r).norm() / r.norm()) for h, r in zip(last[m], last["fp32"], strict=True)]
            kl = [float(F.kl_div(F.log_softmax(model.output(model.norm(h)), -1), r, log_target=True,
                                 reduction="none").sum(-1).mean())
                  for h, r in zip(last[m], ref_logp, strict=True)]
            result["modes"][m] = {"block_s": round(statistics.median(times[m]), 2), "block_s_each": times[m],
                                  "hidden_rel_err": round(statistics.fmean(err), 5),
                                  "kl_to_fp32": statistics.fmean(kl)}
            print(m, result["modes"][m])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(out)


if __name__ == "__main__":
    main()
