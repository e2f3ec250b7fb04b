"""Are two artifacts' weights the same? sha256 of each safetensors file and whether every tensor is equal.

    smelt compare-weights runs/qlr/qat-2of4 runs/qat192lr24/qat [--out weights-sha256.json]
    python -m eval.compare_weights ...                    # the same

Exit status 0 when every tensor is equal, 1 when one differs.

Files can differ in bytes (header order, metadata) while every tensor is equal, so both are reported.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from safetensors.torch import load_file

from core.errors import ArgumentParser, SmeltError, run_cli
from core.files import atomic_write_text, sha256_file

FILES = ("model.safetensors", "qparams.safetensors", "masks.safetensors")


def compare(a: Path, b: Path) -> dict:
    out = {"files": {}, "tensors_equal": {}}
    for name in FILES:
        if not ((a / name).is_file() and (b / name).is_file()):
            continue  # an artifact kind without this file (a dense model has no masks)
        out["files"][name] = {str(d): sha256_file(d / name) for d in (a, b)}
        ta, tb = load_file(a / name), load_file(b / name)
        out["tensors_equal"][name] = sorted(ta) == sorted(tb) and all(ta[k].equal(tb[k]) for k in ta)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m eval.compare_weights", description=__doc__.split("\n")[0])
    ap.add_argument("a", type=Path, help="artifact or release directory")
    ap.add_argument("b", type=Path, help="the directory compared with it")
    ap.add_argument("--out", type=Path, help="write the JSON here (temp file, then rename)")
    args = ap.parse_args(argv)
    for d in (args.a, args.b):
        if not (d / "model.safetensors").is_file():
            raise SmeltError(f"{d}: no model.safetensors (not an artifact directory)")
    argv = sys.argv[1:] if argv is None else argv
    res = {"command": " ".join(["python -m eval.compare_weights", *argv]), **compare(args.a, args.b)}
    text = json.dumps(res, indent=1)
    if args.out:
        atomic_write_text(args.out, text + "\n")
    print(text)
    return 0 if all(res["tensors_equal"].values()) else 1


if __name__ == "__main__":
    run_cli(main)
