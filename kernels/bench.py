"""Kernel speed on a GPU, in one run: smelt's W4A16, 2:4 and 2:4 + W4 kernels against cuBLAS bf16, PyTorch's
semi-structured 2:4 (cuSPARSELt) and tinygemm W4 (`aten._weight_int4pack_mm`), at the release's group 64,
for every projection of Llama-3.1-8B and SmolLM2 (q, k, v, o, gate, up, down and the fused qkv and gate-up),
plus decode tokens/s of whole random models built on the kernels.

    python -m kernels.bench [--models llama-3.1-8b,smollm2-135m] [--m 1,16,2048] [--decode-tokens 64]
                            [--inspect results/kernels/inspect.json] [--out results/bench/kernels/<gpu>.json]

Per (layer, M, path): the median time of `triton.testing.do_bench`, effective GB/s (weights in the format +
activations in and out / time), TFLOP/s, the speed-up over cuBLAS bf16 measured in the same run, the max
error against the fp32 product of the dequantized weight, and — beside it — kernels.inspect's model estimate
of the same speed-up and the ratio measured / model. Decode: greedy tokens/s of a random-weight model of each
shape with every block Linear on one format (KV cache, batch 1; attention and norms in torch), eager and with
the whole step captured once as a CUDA graph on a static KV cache (models.llama.StaticKVCache), and the time
of all its Linears for one token replayed as a CUDA graph. A GPU is required: the CPU runs the
kernels in Triton's interpreter, where time means nothing.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from core.errors import ArgumentParser, SmeltError, run_cli
from core.files import atomic_write_text
from core.packing import pack_24, pack_int4
from core.patterns import NMPattern
from kernels.roofline import LAYERS, weight_bytes

GROUP = 64  # the release's
PATHS = ("bf16", "w4", "24", "24w4", "torch 2:4", "tinygemm w4")  # "bf16" is cuBLAS: the reference
FORMAT = {"bf16": "bf16", "w4": "w4", "24": "24", "24w4": "24w4", "torch 2:4": "24", "tinygemm w4": "w4"}
SHAPES = {  # (d, layers, heads, kv heads, ffn, vocab) of the decode models
    "llama-3.1-8b": (4096, 32, 32, 8, 14336, 128256), "smollm2-135m": (576, 30, 9, 3, 1536, 49152)}


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """GB/s of a device-to-device copy (read + write counted), the ceiling for a memory-bound kernel."""
    from triton.testing import do_bench

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / do_bench(lambda: dst.copy_(src), warmup=50, rep=200, return_mode="median") / 1e6


def random_weight(n: int, k: int, gen: torch.Generator, device: str) -> dict[str, torch.Tensor]:
    """One [N, K] weight in every stored form: int4 codes with bf16 scales (g64), a 2:4 mask, the packed W4,
    2:4 values, 2:4 + W4 tensors, and the dense bf16 weights they decompress to."""
    q = torch.randint(-8, 8, (n, k), generator=gen, device=device, dtype=torch.int32)
    scale = (torch.rand(n, k // GROUP, generator=gen, device=device) * 0.02 + 0.001).to(torch.bfloat16)
    keep = NMPattern(2, 4).keep_top(torch.rand(n, k, generator=gen, device=device))
    dense = (q.float() * scale.float().repeat_interleave(GROUP, 1)).to(torch.bfloat16)
    w24 = dense * keep
    values, meta = pack_24(w24, keep)
    kept, kmeta = pack_24(q * keep, keep)
    return {"q": q, "scale": scale, "dense": dense, "w24": w24, "packed": pack_int4(q), "values": values,
            "meta": meta, "kept": pack_int4(kept), "kmeta": kmeta}


def tinygemm(w: dict, inner_k_tiles: int = 8):
    """y = x @ W.T through tinygemm W4 at group 64: the codes + 8 converted to its layout (on a GPU from uint8
    pairs, even input in the high nibble; on a CPU from int32 codes) and [K/g, N, 2] (scale, zero) with zero
    0, so that w = (code - 8) x scale. Returns the call on x."""
    u = w["q"] + 8
    sz = torch.stack([w["scale"], torch.zeros_like(w["scale"])], -1).transpose(0, 1).contiguous()
    if u.is_cuda:
        u8 = u.to(torch.uint8)
        packed = torch.ops.aten._convert_weight_to_int4pack((u8[:, ::2] << 4 | u8[:, 1::2]).contiguous(),
                                                            inner_k_tiles)
        return lambda x: torch.ops.aten._weight_int4pack_mm(x, packed, GROUP, sz)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u.to(torch.int32).contiguous(), inner_k_tiles)
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, sz)


def _paths(x: torch.Tensor, w: dict) -> dict:
    """path -> (call, reference weight [N, K] fp32) for the paths this build and GPU have; errors as strings."""
    from kernels.matmul import sparse24_matmul, sparse24_w4a16_matmul, w4a16_matmul

    dense, w24 = w["dense"].float(), w["w24"].float()
    out: dict = {"bf16": (lambda: x @ w["dense"].T, dense),
                 "w4": (lambda: w4a16_matmul(x, w["packed"], w["scale"], GROUP), dense),
                 "24": (lambda: sparse24_matmul(x, w["values"], w["meta"]), w24),
                 "24w4": (lambda: sparse24_w4a16_matmul(x, w["kept"], w["kmeta"], w["scale"], GROUP), w24)}
    try:
        from torch.sparse import to_sparse_semi_structured

        ws = to_sparse_semi_structured(w["w24"])
        out["torch 2:4"] = (lambda: torch.mm(ws, x.T).T, w24)
    except Exception as e:  # noqa: BLE001 - not in this build or GPU: a row that says so
        out["torch 2:4"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    try:
        mm = tinygemm(w)
        out["tinygemm w4"] = (lambda: mm(x), dense)
    except Exception as e:  # noqa: BLE001
        out["tinygemm w4"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return out


def layer_case(model: str, layer: str, k: int, n: int, ms: list[int], gen: torch.Generator,
               estimates: dict) -> list[dict]:
    """One projection at every M: a row per (M, path)."""
    from triton.testing import do_bench

    w = random_weight(n, k, gen, "cuda")
    rows = []
    for m in ms:
        x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
        base = None
        for path, run in _paths(x, w).items():
            row = {"model": model, "layer": layer, "K": k, "N": n, "M": m, "path": path}
            if isinstance(run, str):
                rows.append({**row, "error": run})
                continue
            call, ref_w = run
            try:
                ref = x.float() @ ref_w.T
                err = ((call().float() - ref).abs().max() / ref.abs().max()).item()
                t = do_bench(call, warmup=25, rep=100, return_mode="median")
            except Exception as e:  # noqa: BLE001 - a shape a path cannot take is a row, not a crash
                rows.append({**row, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"})
                continue
            base = t if path == "bf16" else base
            moved = weight_bytes(FORMAT[path], n, k, GROUP) + 2 * (m * k + m * n)
            row.update(ms=t, GBps=moved / t / 1e6, TFLOPs=2 * m * n * k / t / 1e9, max_rel_err=err)
            if base:
                row["speedup_vs_bf16"] = base / t
                model_est = estimates.get((model, layer, m, path))
                if model_est:
                    row.update(model_speedup=model_est, measured_over_model=row["speedup_vs_bf16"] / model_est)
            rows.append(row)
    return rows


def model_estimates(path: str | Path) -> dict:
    """(model, layer, M, path) -> the inspect report's model speed-up over bf16, for smelt's own kernels."""
    p = Path(path)
    if not p.exists():
        return {}
    rows = json.loads(p.read_text()).get("model", {}).get("rows", [])
    return {(r["model"], r["layer"], r["M"], r["format"]): r["speedup_vs_bf16"] for r in rows
            if "speedup_vs_bf16" in r and r["format"] != "bf16"}


def random_model(name: str, fmt: str, gen: torch.Generator):
    """A random-weight model of `name`'s shape with every block Linear a KernelLinear in `fmt` (w4, 24w4 or
    bf16: plain Linears), on the GPU in bf16."""
    from kernels.linear import KernelLinear
    from models.llama import LlamaConfig, Transformer

    d, n_layers, heads, kv, ffn, vocab = SHAPES[name]
    cfg = LlamaConfig(dim=d, n_layers=n_layers, n_heads=heads, n_kv_heads=kv, ffn_hidden=ffn, vocab_size=vocab,
                      max_seq_len=4096)
    with torch.device("meta"):
        model = Transformer(cfg)
    model = model.to_empty(device="cuda").to(torch.bfloat16)
    for p in model.parameters():
        if p.ndim == 2:
            p.data.normal_(0, 0.02, generator=gen)
        else:  # norm weights
            p.data.fill_(1.0)
    model.init_rope("cuda")
    if fmt == "bf16":
        return model.eval()
    for block in model.layers.values():
        for parent in (block.attention, block.feed_forward):
            for attr, lin in list(parent.named_children()):
                if not isinstance(lin, torch.nn.Linear):
                    continue
                w = random_weight(lin.out_features, lin.in_features, gen, "cuda")
                kl = KernelLinear(lin.in_features, lin.out_features, "w4" if fmt == "w4" else "2:4+w4", GROUP)
                if fmt == "w4":
                    kl._add("w4", None, packed=w["packed"], scale=w["scale"])
                else:
                    kl._add("s24w4", None, packed=w["kept"], meta=w["kmeta"], scale=w["scale"])
                setattr(parent, attr, kl)
    return model.eval()


@torch.no_grad()
def graph_decode(model, prompt: torch.Tensor, tokens: int) -> float:
    """Greedy decode tokens/s with the whole step (the model on a StaticKVCache, and the argmax written back
    as the next input) captured once as a CUDA graph and replayed per token."""
    n = prompt.shape[1]
    cache = model.new_cache(1, n + tokens + 1, static=True)
    nxt = model(prompt, cache)[:, -1:].argmax(-1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and tune every kernel outside the graph, then roll the cache back
        model(nxt, cache)
        for c in cache.values():
            c.truncate(n)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # reads nxt, then overwrites it with the step's argmax
        nxt.copy_(model(nxt, cache)[:, -1:].argmax(-1))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(tokens):
        graph.replay()
    torch.cuda.synchronize()
    return tokens / (time.perf_counter() - t0)


@torch.no_grad()
def decode_case(name: str, fmt: str, tokens: int, gen: torch.Generator) -> dict:
    """Greedy decode tokens/s (eager, KV cache; and the whole step as a CUDA graph on a static cache) and one
    token's Linears replayed as a CUDA graph."""
    model = random_model(name, fmt, gen)
    prompt = torch.randint(0, SHAPES[name][5], (1, 16), generator=gen, device="cuda")
    cache = model.new_cache(1, prompt.shape[1] + tokens + 1)
    nxt = model(prompt, cache)[:, -1:].argmax(-1)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(tokens):
        nxt = model(nxt, cache)[:, -1:].argmax(-1)
    torch.cuda.synchronize()
    eager = tokens / (time.perf_counter() - t0)
    graphed = graph_decode(model, prompt, tokens)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) or hasattr(m, "_paths")]
    linears = [m for m in linears if m is not model.output]
    xs = [torch.randn(1, m.in_features, device="cuda", dtype=torch.bfloat16) for m in linears]
    for m, x in zip(linears, xs, strict=True):  # compile and tune outside the graph
        m(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for m, x in zip(linears, xs, strict=True):
            m(x)
    from triton.testing import do_bench

    linear_ms = do_bench(graph.replay, warmup=10, rep=50, return_mode="median")
    del model, cache
    torch.cuda.empty_cache()
    return {"model": name, "format": fmt, "tokens": tokens, "eager_tokens_per_s": eager,
            "graph_tokens_per_s": graphed, "linears_graph_ms_per_token": linear_ms, "linears": len(linears)}


def _ints(value: str, what: str) -> list[int]:
    try:
        out = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise SmeltError(f"{what}: {value!r} is not a comma-separated list of integers") from None
    if not out or min(out) < 1:
        raise SmeltError(f"{what}: {value!r} needs positive integers")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m kernels.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(LAYERS), help=f"comma-separated of {', '.join(LAYERS)}")
    ap.add_argument("--m", default="1,16,2048", help="comma-separated token counts M")
    ap.add_argument("--decode-tokens", type=int, default=64, help="tokens per decode measurement (0: none)")
    ap.add_argument("--inspect", default="results/kernels/inspect.json", help="kernels.inspect report (the model)")
    ap.add_argument("--out", help="JSON file (default: results/bench/kernels/<gpu name>.json)")
    args = ap.parse_args(argv)
    models = args.models.split(",")
    unknown = [n for n in models if n not in LAYERS]
    if unknown:
        raise SmeltError(f"--models: {unknown[0]!r} is not one of {', '.join(LAYERS)}")
    ms = _ints(args.m, "--m")
    if args.decode_tokens < 0:
        raise SmeltError(f"--decode-tokens must be >= 0, got {args.decode_tokens}")
    if not torch.cuda.is_available():
        raise SmeltError("kernels.bench needs a CUDA GPU (on a CPU the kernels run in the interpreter)")
    import triton

    gpu = torch.cuda.get_device_name()
    gen = torch.Generator(device="cuda").manual_seed(0)
    estimates = model_estimates(args.inspect)
    t0 = time.time()
    res = {"device": gpu, "torch": torch.__version__, "triton": triton.__version__, "group_size": GROUP,
           "timing": "median of triton.testing.do_bench", "copy_GBps": copy_bandwidth(), "layers": [],
           "decode": []}
    print(f"{gpu}: copy bandwidth {res['copy_GBps']:.0f} GB/s")
    for model in models:
        for layer, k, n in LAYERS[model]:
            rows = layer_case(model, layer, k, n, ms, gen, estimates)
            res["layers"] += rows
            for m in ms:
                cells = "  ".join(f"{r['path']} {r['ms'] * 1e3:7.1f}us {r.get('speedup_vs_bf16', 0):4.2f}x"
                                  if "ms" in r else f"{r['path']} error" for r in rows if r["M"] == m)
                print(f"{model:13s} {layer:7s} {k:5d}->{n:5d} M={m:4d}  {cells}", flush=True)
    for model in models if args.decode_tokens else []:
        for fmt in ("bf16", "w4", "24w4"):
            d = decode_case(model, fmt, args.decode_tokens, gen)
            res["decode"].append(d)
            print(f"decode {model} {fmt}: {d['eager_tokens_per_s']:.1f} tok/s eager, "
                  f"{d['graph_tokens_per_s']:.1f} tok/s as a CUDA graph, "
                  f"linears {d['linears_graph_ms_per_token']:.3f} ms/token in a CUDA graph", flush=True)
    res["wall_s"] = round(time.time() - t0, 1)
    out = args.out or f"results/bench/kernels/{gpu.replace(' ', '-')}.json"
    atomic_write_text(out, json.dumps(res, indent=1) + "\n")
    print(f"written {out}")
    return 0


if __name__ == "__main__":
    run_cli(main)
