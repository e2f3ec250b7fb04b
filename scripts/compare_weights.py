"""Are two artifacts' weights the same? sha256 of each safetensors file and whether every tensor is equal.

    python scripts/compare_weights.py runs/qlr/qat-2of4 runs/qat192lr24/qat --out qat-weights-sha256.json

Files can differ in bytes (header order, metadata) while every tensor is equal, so both are reported.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

from safetensors.torch import load_file

FILES = ("model.safetensors", "qparams.safetensors", "masks.safetensors")


def compare(a: Path, b: Path) -> dict:
    out = {"files": {}, "tensors_equal": {}}
    for name in FILES:
        if not ((a / name).is_file() and (b / name).is_file()):
            continue  # an artifact kind without this file (a dense model has no masks)
        out["files"][name] = {str(d): hashlib.sha256((d / name).read_bytes()).hexdigest() for d in (a, b)}
        ta, tb = load_file(a / name), load_file(b / name)
        out["tensors_equal"][name] = sorted(ta) == sorted(tb) and all(ta[k].equal(tb[k]) for k in ta)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--out", type=Path, help="write the JSON here (temp file, then rename)")
    args = ap.parse_args()
    for d in (args.a, args.b):
        if not (d / "model.safetensors").is_file():
            sys.exit(f"error: {d}: no model.safetensors (not an artifact directory)")
    res = {"command": " ".join(["python", "scripts/compare_weights.py", *sys.argv[1:]]), **compare(args.a, args.b)}
    text = json.dumps(res, indent=1)
    if args.out:
        tmp = args.out.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(args.out)
    print(text)
    sys.exit(0 if all(res["tensors_equal"].values()) else 1)


if __name__ == "__main__":
    main()
