"""Peak memory of `qat.release` and `qat.verify` on a model larger than this machine's memory.

    python -m qat.release_memory [--flavor llama3.1-8b] [--workdir DIR] [--out results/release-memory/FLAVOR.json]
                                 [--limit-gib 4] [--keep]

Writes a random artifact of the flavor's shape block by block (never held whole: fp32 weights on the
int4 g64 grid, 2:4 on the MLP Linears, the masks and scales beside them, a prune stage declaring 2:4 in
its chain), then runs `python -m qat.release` and `python -m qat.verify` on it, each under
`/usr/bin/time -v`, and records each command's peak resident set, wall time and exit status beside the
machine. Random weights: the numbers measure memory and time, not quality. The work directory is removed
afterwards unless --keep.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from core.artifact import parent_record, write_manifest
from core.device import machine_record
from core.errors import ArgumentParser, SmeltError, run_cli
from core.files import atomic_write_text
from core.hf_names import to_hf_name
from core.masks import StreamedMasks
from core.safetensors_stream import StreamedSafetensors
from models.hf_io import config_to_hf
from models.llama import FLAVORS, LlamaConfig
from qat.qparams import StreamedQparams
from qat.quantizers import QuantSpec

ROOT = Path(__file__).resolve().parent.parent
SPEC = QuantSpec(bits=4, symmetric=True, group_size=64)
LINEARS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
           "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
SPARSE = ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3")  # 2:4 on the MLPs, as the default release


def linear_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, int]]:
    """{our module name: (out, in)} of every block Linear."""
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    per = {"attention.wq": (q, cfg.dim), "attention.wk": (kv, cfg.dim), "attention.wv": (kv, cfg.dim),
           "attention.wo": (cfg.dim, q), "feed_forward.w1": (cfg.ffn_hidden, cfg.dim),
           "feed_forward.w2": (cfg.dim, cfg.ffn_hidden), "feed_forward.w3": (cfg.ffn_hidden, cfg.dim)}
    return {f"layers.{i}.{k}": per[k] for i in range(cfg.n_layers) for k in LINEARS}


def random_24(shape: tuple[int, int], g: torch.Generator) -> torch.Tensor:
    """A keep-mask keeping 2 of every 4 inputs, at random positions."""
    out, inn = shape
    order = torch.rand(out, inn // 4, 4, generator=g).argsort(-1)
    return (order < 2).reshape(out, inn)


def write_random_artifact(out: Path, cfg: LlamaConfig, seed: int = 0) -> Path:
    """A quantized (W4 g64) artifact with 2:4 MLPs of `cfg`'s shape, written one tensor at a time."""
    g = torch.Generator().manual_seed(seed)
    prune, art = out / "prune", out / "qat"
    prune.mkdir(parents=True, exist_ok=True)
    write_manifest(prune, "prune", {"pattern": "2:4", "note": "random weights for a memory measurement"})
    art.mkdir(parents=True, exist_ok=True)
    (art / "config.json").write_text(json.dumps(config_to_hf(cfg), indent=2) + "\n")
    shapes = linear_shapes(cfg)
    top = {"tok_embeddings.weight": (cfg.vocab_size, cfg.dim), "norm.weight": (cfg.dim,)}
    if not cfg.tie_embeddings:
        top["output.weight"] = (cfg.vocab_size, cfg.dim)
    norms = {f"layers.{i}.{n}.weight": (cfg.dim,) for i in range(cfg.n_layers) for n in ("attention_norm", "ffn_norm")}
    names = {**top, **norms, **{f"{k}.weight": s for k, s in shapes.items()}}
    model = StreamedSafetensors(art / "model.safetensors", [(to_hf_name(k), torch.float32, s) for k, s in names.items()],
                                metadata={"format": "pt"})
    qparams = StreamedQparams(art, shapes, SPEC)
    masks = StreamedMasks(art, {k: s for k, s in shapes.items() if k.split(".", 2)[2] in SPARSE})
    for k, shape in tqdm(names.items(), desc="random artifact", unit="tensor"):
        module = k.removesuffix(".weight")
        if module not in shapes:
            rows = 16384  # embeddings in blocks of rows
            for a in range(0, shape[0], rows if len(shape) == 2 else shape[0]):
                n = min(rows, shape[0] - a) if len(shape) == 2 else shape[0]
                part = torch.randn(n, *shape[1:], generator=g) * (0.02 if len(shape) == 2 else 1.0)
                model.write(to_hf_name(k), part if len(shape) == 2 else part + 1.0, part=len(shape) == 2)
            continue
        scale = torch.rand(shape[0], SPEC.n_groups(shape[1]), generator=g) * 1e-3 + 1e-3
        w = torch.randint(-8, 8, shape, generator=g, dtype=torch.int8).float()
        w *= scale.repeat_interleave(SPEC.group_size, dim=1)
        if module.split(".", 2)[2] in SPARSE:
            mask = random_24(shape, g)
            w *= mask
            masks.write({module: mask})
        model.write(to_hf_name(k), w)
        qparams.write({module: (scale, None)})
        del w
    for f in (model, qparams, masks):
        f.close()
    write_manifest(art, "qat", {"quantization": {"bits": 4, "group_size": 64}}, parent=parent_record(prune))
    return art


def timed(cmd: list[str], log: Path) -> dict:
    """Run `cmd` under /usr/bin/time -v: exit status, peak RSS and wall time, and its last output lines."""
    if not Path("/usr/bin/time").is_file():
        raise SmeltError("/usr/bin/time is missing (Debian package `time`): it measures the peak resident set")
    t0 = time.time()
    with open(log, "w") as f:
        rc = subprocess.run(["/usr/bin/time", "-v", *cmd], check=False, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    text = log.read_text()
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    return {"command": " ".join(cmd[2:] if cmd[1] == "-m" else cmd), "exit_status": rc,
            "max_rss_bytes": int(rss.group(1)) * 1024 if rss else None, "wall_s": round(time.time() - t0, 1),
            "output_tail": output_tail(text.splitlines())}


def output_tail(lines: list[str], n: int = 8) -> list[str]:
    """The last `n` lines a command printed, without /usr/bin/time's report (tab-indented), progress bars (their
    carriage-return redraws) or blank lines."""
    kept = [ln for line in lines if not line.startswith("\t") for ln in line.split("\r")]
    return [ln for ln in kept if ln.strip() and "%|" not in ln][-n:]


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m qat.release_memory", description=__doc__.split("\n\n")[0])
    ap.add_argument("--flavor", default="llama3.1-8b", choices=sorted(FLAVORS), help="the model shape")
    ap.add_argument("--workdir", help="where the artifact and release go (default: a temporary directory)")
    ap.add_argument("--out", help="the JSON written (default: results/release-memory/<flavor>.json, the docs' table)")
    ap.add_argument("--limit-gib", type=float, default=4.0, help="the peak resident set each command must stay under")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args(argv)
    cfg = FLAVORS[args.flavor]
    out = Path(args.out or f"results/release-memory/{args.flavor}.json")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="smelt-release-memory-"))
    if work.exists() and any(work.iterdir()):
        raise SmeltError(f"--workdir {work} is not empty")
    try:
        t0 = time.time()
        art = write_random_artifact(work, cfg)
        made = round(time.time() - t0, 1)
        rel = work / "release"
        py = [sys.executable, "-m"]
        runs = {"release": timed([*py, "qat.release", "--artifact", str(art), "--out", str(rel)], work / "release.log")}
        if runs["release"]["exit_status"] == 0:
            runs["verify"] = timed([*py, "qat.verify", str(rel)], work / "verify.log")
        limit = int(args.limit_gib * (1 << 30))
        record = {
            "what": f"peak resident set of qat.release and qat.verify on a random {args.flavor}-shaped W4 g64 "
                    "artifact with 2:4 MLPs (fp32 weights on the grid), each under /usr/bin/time -v",
            "flavor": args.flavor, "config": config_to_hf(cfg), "parameters": sum(
                s[0] * s[1] for s in linear_shapes(cfg).values()) + cfg.vocab_size * cfg.dim * (1 + (not cfg.tie_embeddings)),
            "artifact_bytes": dir_bytes(art), "artifact_write_s": made,
            "release_bytes": dir_bytes(rel) if rel.is_dir() else None,
            "limit_bytes": limit, "runs": runs,
            "within_limit": all(r["exit_status"] == 0 and r["max_rss_bytes"] <= limit for r in runs.values())
                            and len(runs) == 2,
            "machine": machine_record(),
        }
        atomic_write_text(out, json.dumps(record, indent=2) + "\n")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    for name, r in runs.items():
        print(f"{name}: exit {r['exit_status']}, peak RSS {r['max_rss_bytes'] / (1 << 30):.2f} GiB, {r['wall_s']} s")
    print(f"written {out}")
    return 0 if record["within_limit"] else 1


if __name__ == "__main__":
    run_cli(main)
