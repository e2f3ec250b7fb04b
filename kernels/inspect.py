"""Compile the Triton matmul for an NVIDIA GPU without one, read what the compiler made, and feed it to a
roofline model (kernels.roofline).

    python -m kernels.inspect [--arch 90] [--formats bf16,w4,24,24w4,w4-decode,...] [--configs all|0,3]
                              [--out results/kernels/inspect.json] [--jobs 2] [--table]

Every weight format x every configuration of `TILE_CONFIGS` (kernels.tile, as kernels.matmul launches it
for 2 <= M <= 64 with split-K, and for larger M) and the M = 1 kernels (kernels.decode) are compiled for
sm_90a (and sm_80 with `--arch 80,90`): bf16 activations, bf16 scales, group 64, fp32 accumulation, the
launcher's strides and Triton's specialisation of the integer arguments (a 1 becomes a constant, a multiple
of 16 is marked divisible). The shape is Llama-3.1-8B's gate projection (4096 -> 14336) at M = 16 for the
small config, 2048 for the large ones, 1 for the decode formats; every layer of the model has N and K
divisible by 16 and so gets the same code.

Read per variant: registers and spilled bytes (ptxas -v), shared memory (what the launch asks for, beside
kernels.tile's estimate that the autotuner prunes with) and whether one block may have it (227 KB on sm_90,
163 KB on sm_80), the main loop, its tensor-core instruction, and the global loads of one iteration per
stream (activations, weights, 2:4 metadata, scales).

- Main loop: in the SASS, the widest span from a backward branch's target to the branch that holds a
  tensor-core instruction (the K loop is the kernel's only loop with a dot; the M = 1 kernels' widest
  backward span). Its instructions are counted without NOPs: what one warp issues per iteration.
- Instructions per weight: loop instructions / (BLOCK_N x BLOCK_K / threads), i.e. what one thread issues
  per weight of the [BLOCK_K, BLOCK_N] tile it helps rebuild and multiply.
- Loads per stream: in the PTX's loop (LLVM's "Loop Header" label to the branch back to it), each
  `ld.global` / `cp.async` is attributed to the pointer argument its address is computed from (def-use
  chains); its width is the instruction's (vector x element, or the cp.async size). "reread" is the bytes
  those loads fetch per iteration / the bytes the tile holds: > 1 means the same bytes are loaded again.

`--table` prints the markdown tables of an existing --out file without compiling.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import platform
import queue
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import triton
from tqdm import tqdm
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

from core.device import machine_record
from core.errors import ArgumentParser, SmeltError, run_cli
from core.files import atomic_write_text, read_json
from kernels import roofline
from kernels.decode import decode_call
from kernels.matmul import ALL, FORMAT, LARGE_CONFIGS, SMALL_OPTIONS, small_block
from kernels.sass import loop_stats, main_loop, parse_sass, ptx_streams
from kernels.tile import smem_bytes, tile_call, tile_kernel

ARCHS = (80, 90)
FORMATS = {name: flags for flags, name in FORMAT.items()}  # name -> (QUANT, SPARSE), kernels.matmul's map inverted
# the M = 1 kernels (kernels.decode), compiled with their own plan's tile
DECODE_FORMATS = {"w4-decode": "w4", "24w4-decode": "24w4", "24-decode": "24"}
LABELS = {"bf16": "bf16 (Triton)", "w4": "W4A16", "24": "2:4", "24w4": "2:4+W4", "w4-decode": "W4A16 M=1",
          "24w4-decode": "2:4+W4 M=1", "24-decode": "2:4 M=1"}
ALL_FORMATS = [*FORMATS, *DECODE_FORMATS]
GROUP = 64
SHAPE = {"N": 14336, "K": 4096}  # Llama-3.1-8B's gate projection
# the tile kernel's configurations as kernels.matmul launches them: (name, M compiled at, (BLOCK_M, BLOCK_N),
# warps, stages, small route: split-K and the swapped dot, formats); the decode formats have one, at M = 1
_SMALL = (SMALL_OPTIONS["num_warps"], SMALL_OPTIONS["num_stages"], True)
TILE_CONFIGS = [("small", 16, small_block(16), *_SMALL, ALL),
                ("small wide", 16, small_block(16, SHAPE["N"], "24w4"), *_SMALL, ("24w4",))] + [
    (f"large {i}", 2048, (bm, bn), w, st, False, fmts) for i, (bm, bn, w, st, fmts) in enumerate(LARGE_CONFIGS)]
DECODE_M = 1
STREAMS = {"x_ptr": "activations", "w_ptr": "weights", "meta_ptr": "metadata", "s_ptr": "scales",
           "y_ptr": "output", "o_ptr": "output"}  # kernel pointer arguments by name
SMEM_LIMIT = {80: 163 * 1024, 90: roofline.H100_SXM.smem_per_block}  # most shared memory a block may use: A100, H100
ROOT = Path(__file__).resolve().parents[1]


def _tensors(fmt: str, shape: dict, group: int) -> tuple:
    quant, sparse = FORMATS[DECODE_FORMATS.get(fmt, fmt)]
    m, n, k = shape["M"], shape["N"], shape["K"]
    stored = k // 2 if sparse else k
    x = torch.empty(m, k, dtype=torch.bfloat16)
    w = torch.empty(n, stored // 8, dtype=torch.int32) if quant else torch.empty(n, stored, dtype=torch.bfloat16)
    meta = torch.empty(n, k // 32, dtype=torch.int32) if sparse else None
    scale = torch.empty(n, k // group, dtype=torch.bfloat16) if quant else None
    return x, w, meta, scale, torch.empty(m, n, dtype=torch.bfloat16)


def configs_of(fmt: str) -> list[int]:
    """The variants kernels.matmul may launch for a format: the M = 1 kernel's one, or its tile configs."""
    if fmt in DECODE_FORMATS:
        return [0]
    return [i for i, c in enumerate(TILE_CONFIGS) if fmt in c[6]]


def variant_launch(fmt: str, config: int, shape: dict = SHAPE, group: int = GROUP) -> tuple:
    """(kernel, arguments, keyword options, shape compiled, splits) of one variant: a TILE_CONFIGS entry of
    the tile kernel, or for a decode format kernels.decode's M = 1 launch."""
    if fmt in DECODE_FORMATS:
        shape = {**shape, "M": DECODE_M}
        x, w, meta, scale, y = _tensors(fmt, shape, group)
        kernel, grid, args, opts, _ = decode_call(x, w, meta, scale, y, group, DECODE_FORMATS[fmt])
        return kernel, args, {"num_stages": 3, **opts}, shape, grid[1]
    _, m, block, warps, stages, split_k, _ = TILE_CONFIGS[config]
    shape = {**shape, "M": m}
    x, w, meta, scale, y = _tensors(fmt, shape, group)
    grid, args, opts, _ = tile_call(x, w, meta, scale, y, group, fmt, block, split_k, dot_fp32=False, swap=split_k)
    return tile_kernel, args, {**opts, "num_warps": warps, "num_stages": stages}, shape, grid[1]


# --- one variant ------------------------------------------------------------------------------------------------

def tile_bytes(fmt: str, bm: int, bn: int, bk: int, group: int = GROUP) -> dict[str, float]:
    """Bytes of each stream one program needs per K step: what a load without repeats would read."""
    quant, sparse = FORMATS[DECODE_FORMATS.get(fmt, fmt)]
    stored = bk / 2 if sparse else bk
    out = {"activations": bm * bk * 2, "weights": stored / 8 * bn * 4 if quant else stored * bn * 2}
    if sparse:
        out["metadata"] = bk / 32 * bn * 4
    if quant:
        out["scales"] = -(-bk // group) * bn * 2
    return out


def _tool(name: str) -> str:
    return getattr(triton.knobs.nvidia, name).path


def compile_launch(fn: JITFunction, args: tuple, kw: dict, arch: int) -> tuple:
    """Compile `fn[grid](*args, **kw)` for sm_<arch> as the launcher would specialise it, without a GPU:
    (compiled kernel, constexprs, attrs, ptxas log, cuobjdump -res-usage, cuobjdump -sass)."""
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    # the launcher's own path from arguments to a specialisation (which ints are constant or divisible by 16)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, spec, opts = binder(*args, **kw)
    options, signature, constexprs, attrs = fn._pack_args(backend, kw, bound, spec, opts)
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    knobs = (triton.knobs.nvidia, "dump_ptxas_log"), (triton.knobs.compilation, "always_compile")
    saved = [getattr(o, a) for o, a in knobs]
    try:
        for o, a in knobs:  # a cache hit would skip ptxas and its log (registers, spills)
            setattr(o, a, True)
        with contextlib.redirect_stdout(io.StringIO()) as log:
            kernel = triton.compile(src, target=target, options=options.__dict__)
    finally:
        for (o, a), v in zip(knobs, saved):
            setattr(o, a, v)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        usage, sass = (subprocess.run([_tool("cuobjdump"), flag, str(cubin)], capture_output=True, text=True,
                                      check=True).stdout for flag in ("-res-usage", "-sass"))
    return kernel, constexprs, attrs, log.getvalue(), usage, sass


def compile_variant(fmt: str, config: int, arch: int, shape: dict = SHAPE, group: int = GROUP) -> dict:
    """Compile one (format, config, arch) offline and read its cubin, SASS and PTX."""
    if not isinstance(tile_kernel, JITFunction):
        raise SmeltError("kernels.matmul was imported under TRITON_INTERPRET=1: compile in a process started "
                         "without it (inspect_all does)")
    fn, args, kw, shape, splits = variant_launch(fmt, config, shape, group)
    kernel, constexprs, attrs, ptxas, usage, sass = compile_launch(fn, args, kw, arch)
    regs = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", ptxas)
    decode = fmt in DECODE_FORMATS
    loop = loop_stats(main_loop(parse_sass(sass), mma=not decode))
    names = [p.name for p in fn.params]
    blocks = {b: kw[b] for b in ("BLOCK_M", "BLOCK_N", "BLOCK_K")}
    threads = 32 * kw["num_warps"]
    weights_per_thread = blocks["BLOCK_N"] * blocks["BLOCK_K"] / threads
    mma = sorted(loop["mma"])
    streams = ptx_streams(kernel.asm["ptx"], {i: STREAMS[n] for i, n in enumerate(names) if n in STREAMS})
    for name, need in tile_bytes(fmt, *blocks.values(), group).items():
        if name in streams:  # > 1: the same bytes loaded again by other loads of the same iteration
            loaded = threads * sum(n * int(k.split()[1][:-1]) for k, n in streams[name]["loads"].items())
            streams[name].update(bytes_per_iteration=loaded, tile_bytes=need, reread=loaded / need)
    return {
        "format": fmt, "arch": arch, "config": config, "name": "M=1" if decode else TILE_CONFIGS[config][0],
        **blocks, "num_warps": kw["num_warps"], "num_stages": kw["num_stages"], "M": shape["M"], "splits": splits,
        "split_k": decode or TILE_CONFIGS[config][5],
        "specialisation": {"constexpr": {names[k[0]]: v for k, v in constexprs.items() if k[0] < names.index("GROUP")},
                           "divisible_by_16": [names[k[0]] for k, v in attrs.items() if v]},
        "registers": int(regs.group(1)), "stack_bytes": int(regs.group(2)),
        "spill_store_bytes": int(spill.group(1)) if spill else None,
        "spill_load_bytes": int(spill.group(2)) if spill else None,
        "shared_bytes": kernel.metadata.shared, "fits_block": kernel.metadata.shared <= SMEM_LIMIT[arch],
        "shared_bytes_estimate": None if decode else smem_bytes(fmt, *blocks.values(), kw["num_stages"]),
        "loop": loop, "instructions_per_weight": loop["instructions"] / weights_per_thread,
        "mma_instruction": (mma[0] if len(mma) == 1 else (", ".join(mma) or ("none (FMA)" if decode else None))),
        "streams": streams,
    }


def _job(job: tuple) -> dict:
    fmt, config, arch = job
    try:
        return compile_variant(fmt, config, arch)
    except Exception as e:  # noqa: BLE001 - a variant that does not compile is a row of the result
        return {"format": fmt, "arch": arch, "config": config, "error": f"{type(e).__name__}: {str(e)[:300]}"}


def _serve() -> None:
    """A compiling worker: one JSON job per stdin line, one JSON result per stdout line."""
    out, sys.stdout = sys.stdout, sys.stderr  # nothing but results on the pipe
    for line in sys.stdin:
        out.write(json.dumps(_job(tuple(json.loads(line)))) + "\n")
        out.flush()


def inspect_all(formats: list[str], configs: list[int], archs: list[int], jobs: int = 1,
                progress: bool = True) -> list[dict]:
    """Every (arch, format, config), compiled by `jobs` worker processes, in that order. The workers start
    without TRITON_INTERPRET, which kernels.matmul sets where there is no CUDA: interpreted kernels cannot
    be compiled."""
    work = [(f, c, a) for a in archs for f in formats
            for c in (configs_of(f) if f in DECODE_FORMATS else [c for c in configs if c in configs_of(f)])]
    todo: queue.SimpleQueue = queue.SimpleQueue()
    for i in range(len(work)):
        todo.put(i)
    results: list = [None] * len(work)
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    bar = tqdm(total=len(work), desc="compile", disable=not progress)

    def worker() -> None:
        cmd = [sys.executable, "-c", "from kernels.inspect import _serve; _serve()"]
        with tempfile.TemporaryFile("w+") as err, subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=ROOT) as p:
            while True:
                try:
                    i = todo.get_nowait()
                except queue.Empty:
                    break
                p.stdin.write(json.dumps(work[i]) + "\n")
                p.stdin.flush()
                line = p.stdout.readline()
                if not line:
                    err.seek(0)
                    last = (err.read().strip().splitlines() or ["no output"])[-1]
                    raise SmeltError(f"a compiling worker died on {work[i]}: {last}")
                results[i] = json.loads(line)
                bar.update()
            p.stdin.close()

    n = max(1, min(jobs, len(work)))
    with ThreadPoolExecutor(n) as ex:
        for f in [ex.submit(worker) for _ in range(n)]:
            f.result()
    bar.close()
    return results


# --- the model on top, and the tables -----------------------------------------------------------------------------

def model_variants(records: list[dict]) -> dict[str, dict[str, roofline.Variant]]:
    """format -> {variant name: Variant} from the sm_90 records that compiled; the M = 1 kernels join their
    format's tile variants under the route kernels.matmul gives them."""
    out: dict[str, dict[str, roofline.Variant]] = {}
    for r in records:
        if r["arch"] != 90 or "error" in r or not r["loop"]["instructions"]:
            continue
        mma = r["mma_instruction"] or ""
        decode = r["format"] in DECODE_FORMATS
        route = "m1" if decode else ("small" if TILE_CONFIGS[r["config"]][5] else "large")
        out.setdefault(DECODE_FORMATS.get(r["format"], r["format"]), {})[r.get("name", str(r["config"]))] = \
            roofline.Variant(r["BLOCK_M"], r["BLOCK_N"], r["BLOCK_K"], r["num_warps"], r["registers"],
                             r["shared_bytes"], r["loop"]["instructions"],
                             "hgmma" if mma.startswith("HGMMA") else "hmma" if mma.startswith("HMMA") else "none",
                             route, decode or TILE_CONFIGS[r["config"]][5])
    return out


def _loads_cell(stream: dict | None) -> str:
    if not stream:
        return "–"
    loads = ", ".join(f"{n}× {k}" for k, n in sorted(stream["loads"].items()))
    return f"{loads}, read {stream['reread']:.0f}×"


def render_tables(report: dict) -> str:
    lines = [("| arch | format | config (BM×BN×BK, warps, stages) | regs | spill st/ld B | smem KB | fits "
              "| loop instrs | instr/weight | MMA | weights | metadata | scales | activations |"), "|---" * 14 + "|"]
    for r in report["variants"]:
        name = r.get("name") or ("M=1" if r["format"] in DECODE_FORMATS else TILE_CONFIGS[r["config"]][0])
        cfg = f"{name}: " + ("–" if "error" in r else f"{r['BLOCK_M']}×{r['BLOCK_N']}×{r['BLOCK_K']}, "
                                   f"{r['num_warps']}, {r['num_stages']}")
        head = f"| sm_{r['arch']} | {LABELS[r['format']]} | {cfg} |"
        if "error" in r:
            lines.append(head + f" {r['error'][:80]} |" + " |" * 11)
            continue
        s = r["streams"]
        lines.append(head + f" {r['registers']} | {r['spill_store_bytes']}/{r['spill_load_bytes']} | "
                     f"{r['shared_bytes'] / 1024:.0f} | {'yes' if r['fits_block'] else 'no'} | "
                     f"{r['loop']['instructions']} | {r['instructions_per_weight']:.1f} | {r['mma_instruction']} | "
                     + " | ".join(_loads_cell(s.get(k)) for k in ("weights", "metadata", "scales", "activations"))
                     + " |")
    rows = report.get("model", {}).get("rows", [])
    fmts = list(dict.fromkeys(r["format"] for r in rows))
    tokens = list(dict.fromkeys(r["M"] for r in rows))
    for model in dict.fromkeys(r["model"] for r in rows):
        by = {(r["layer"], r["M"], r["format"]): r for r in rows if r["model"] == model}
        m_head = " / ".join(map(str, tokens))
        lines += ["", (f"**{model}**, model estimate: bf16 cuBLAS µs and each format's speed-up over it at M = "
                       f"{m_head} (limiter: m memory, i issue, t tensor)"), "",
                  "| layer | K→N | bf16 cuBLAS µs | " + " | ".join(LABELS[f] for f in fmts) + " |",
                  "|---|---|" + "---:|" * (len(fmts) + 1)]
        for layer in dict.fromkeys(r["layer"] for r in rows if r["model"] == model):
            first = by[(layer, tokens[0], fmts[0])]
            cells = [" / ".join(f"{by[(layer, m, fmts[0])]['bf16_cublas_us']:.1f}" for m in tokens)]
            for f in fmts:
                cells.append(" / ".join("–" if "error" in (e := by[(layer, m, f)]) else
                                        f"{e['speedup_vs_bf16']:.2f}{e['limiter'][0]}" for m in tokens))
            lines.append(f"| {layer} | {first['K']}→{first['N']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# --- the command ------------------------------------------------------------------------------------------------

def _parse_list(value: str, allowed, what: str, conv=str) -> list:
    try:
        items = [conv(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise SmeltError(f"{what}: {value!r} is not a comma-separated list") from None
    bad = [v for v in items if v not in allowed]
    if bad or not items:
        raise SmeltError(f"{what}: {bad[0] if bad else value!r} is not one of {', '.join(map(str, allowed))}")
    return list(dict.fromkeys(items))


def _rounded(v):
    """Four significant digits: the model is no more precise, and the JSON stays readable."""
    if isinstance(v, float):
        return float(f"{v:.4g}")
    return {k: _rounded(x) for k, x in v.items()} if isinstance(v, dict) else v


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m kernels.inspect", description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="90", help=f"comma-separated compute capabilities of {ARCHS}")
    ap.add_argument("--formats", default=",".join(ALL_FORMATS), help=f"comma-separated of {', '.join(ALL_FORMATS)}")
    ap.add_argument("--configs", default="all", help=f"'all' or comma-separated indices of TILE_CONFIGS "
                                                     f"(0..{len(TILE_CONFIGS) - 1}: "
                                                     f"{', '.join(c[0] for c in TILE_CONFIGS)}); the M = 1 formats "
                                                     f"have one")
    ap.add_argument("--out", default="results/kernels/inspect.json", help="the JSON written (read by --table)")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="compiling processes")
    ap.add_argument("--table", action="store_true", help="print the markdown tables of --out; compile nothing")
    args = ap.parse_args(argv)
    if args.table:
        print(render_tables(read_json(args.out, "a kernels.inspect report")))
        return 0
    archs = _parse_list(args.arch, ARCHS, "--arch", int)
    formats = _parse_list(args.formats, ALL_FORMATS, "--formats")
    configs = list(range(len(TILE_CONFIGS))) if args.configs == "all" else \
        _parse_list(args.configs, range(len(TILE_CONFIGS)), "--configs", int)
    if args.jobs < 1:
        raise SmeltError(f"--jobs must be >= 1, got {args.jobs}")
    t0 = time.time()
    records = inspect_all(formats, configs, archs, args.jobs)
    report = {"command": "python -m kernels.inspect " + " ".join(sys.argv[1:] if argv is None else argv),
              "machine": machine_record(), "triton": triton.__version__,
              "ptxas": subprocess.run([_tool("ptxas"), "--version"], capture_output=True, text=True,
                                      check=True).stdout.strip().splitlines()[-1],
              "python": platform.python_version(), "compiled_shape": {**SHAPE, "group": GROUP,
                                                                      "dtype": "bfloat16"},
              "variants": records}
    if 90 in archs:
        rows = [{k: _rounded(v) for k, v in r.items()} for r in roofline.model_rows(model_variants(records), GROUP)]
        report["model"] = {"note": "model estimate, not a measurement (kernels/roofline.py)",
                           "gpu": roofline.gpu_record(), "rows": rows}
    report["wall_s"] = round(time.time() - t0, 1)
    atomic_write_text(args.out, json.dumps(report, indent=1) + "\n")
    print(render_tables(report))
    print(f"written {args.out} ({len(records)} variants, {report['wall_s']} s)")
    return 0


if __name__ == "__main__":
    run_cli(main)
