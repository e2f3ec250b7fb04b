"""A roofline model of the Triton matmul on an H100 SXM, from what its compiled code says.

Everything here is a model estimate, pure arithmetic: no GPU, no timing. For a layer (K -> N) at M tokens,
a weight format and one compiled variant (tile, warps, registers, shared memory, main-loop SASS
instructions), the estimate is the largest of three bounds:

- memory:  bytes moved / (HBM bandwidth x efficiency, or less where few SMs have programs: each draws at
           most `sm_share` times its even share, assumed); bytes = the weights in the format (codes or
           values, 2:4 metadata, scales) read once + bf16 activations in and out (+ split-K partials);
- issue:   the busiest SM's warp-instructions of the main loop / (min(4, resident warps) per clock x clock);
- tensor:  the busiest SM's dense tile FLOPs (M padded to BLOCK_M) / (its share of the tensor peak x
           efficiency), HMMA (mma.sync) at an assumed fraction of the HGMMA (wgmma) peak; none for the
           M = 1 kernels, whose fp32 multiply-adds are in their instruction count.

A split-K variant (the M = 1 and small-M kernels) divides K among as many programs as kernels.tile.split
gives, and moves its fp32 partial sums twice. The busiest SM runs ceil(programs / SMs) programs, which is
where the grid's wave quantisation enters. The
bf16 reference is cuBLAS idealised as max(bytes / bandwidth, FLOPs / peak) at the same efficiency, with no
quantisation. Left out: memory latency and how many SMs it takes to reach full bandwidth, L2 (weights are
read from HBM once even when several M tiles read them), the loop's prologue/epilogue, launch overhead,
pipeline and dependency stalls, bank conflicts, clock throttling, the autotuner's own pick.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from kernels.tile import SMALL_M, split


@dataclass(frozen=True)
class GPU:
    name: str
    hbm_bytes_s: float
    tensor_flops: float        # dense bf16, wgmma
    hmma_fraction: float       # mma.sync reaches this share of the wgmma peak (assumed)
    sms: int
    clock_hz: float
    issue_per_clk: int         # warp schedulers per SM, one warp-instruction each per clock
    regs_per_sm: int
    smem_per_sm: int
    smem_per_block: int        # the most one block may ask for
    smem_reserved_per_block: int
    max_warps_per_sm: int
    max_blocks_per_sm: int
    efficiency: float          # share of the HBM and tensor peaks a good kernel reaches
    sm_share: float            # one SM draws at most this many times its even share of HBM bandwidth


H100_SXM = GPU("H100 SXM", hbm_bytes_s=3.35e12, tensor_flops=989e12, hmma_fraction=0.66, sms=132,
               clock_hz=1.755e9, issue_per_clk=4, regs_per_sm=65536, smem_per_sm=228 * 1024,
               smem_per_block=227 * 1024, smem_reserved_per_block=1024, max_warps_per_sm=64,
               max_blocks_per_sm=32, efficiency=0.8, sm_share=2.0)

# Layer shapes (name, in K, out N). Llama-3.1-8B: d 4096, 32 heads of 128, 8 KV heads, ffn 14336;
# SmolLM2-135M: d 576, 9 heads of 64, 3 KV heads, ffn 1536. "qkv" and "gate_up" are the fused projections.
LAYERS = {
    "llama-3.1-8b": [("q", 4096, 4096), ("k", 4096, 1024), ("v", 4096, 1024), ("o", 4096, 4096),
                     ("gate", 4096, 14336), ("up", 4096, 14336), ("down", 14336, 4096), ("qkv", 4096, 6144),
                     ("gate_up", 4096, 28672)],
    "smollm2-135m": [("q", 576, 576), ("k", 576, 192), ("v", 576, 192), ("o", 576, 576), ("gate", 576, 1536),
                     ("up", 576, 1536), ("down", 1536, 576), ("qkv", 576, 960), ("gate_up", 576, 3072)],
}
TOKENS = (1, 16, 2048)
FORMATS = ("bf16", "w4", "24", "24w4")  # bf16 here is the Triton kernel on plain bf16 weights


@dataclass(frozen=True)
class Variant:
    """One compiled kernel as the model needs it."""
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    registers: int
    shared_bytes: int
    loop_instructions: int     # SASS instructions of one main-loop iteration, per warp
    mma: str                   # "hgmma" (wgmma), "hmma" (mma.sync) or "none" (fp32 multiply-add)
    route: str = "large"       # which M kernels.matmul gives it: "m1" (M = 1), "small" (M <= 64), "large"
    split_k: bool = False      # K split so that the waves of programs fill the SMs (kernels.tile.split)


def routes(m: int) -> tuple[str, ...]:
    """The variants kernels.matmul may run at M tokens, in order of preference (bf16 has no M = 1 kernel)."""
    return ("m1", "small") if m == 1 else ("small",) if m <= SMALL_M else ("large",)


def weight_bytes(fmt: str, n: int, k: int, group: int) -> float:
    """Bytes of one [N, K] weight as the kernel reads it: codes/values, 2:4 metadata, bf16 scales."""
    scales = 2 * n * k / group
    per_format = {"bf16": 2 * n * k, "w4": n * k / 2 + scales, "24": n * k + n * k / 8,
                  "24w4": n * k / 4 + n * k / 8 + scales}
    if fmt not in per_format:
        raise ValueError(f"unknown weight format {fmt!r} (one of {', '.join(per_format)})")
    return per_format[fmt]


def blocks_per_sm(v: Variant, gpu: GPU = H100_SXM) -> int:
    """Resident blocks per SM from registers (8 per thread granule, 256 per warp), shared memory and warps;
    0 when one block does not fit."""
    if v.shared_bytes > gpu.smem_per_block:
        return 0
    regs_per_warp = math.ceil(max(v.registers, 1) / 8) * 8 * 32
    by_regs = gpu.regs_per_sm // (regs_per_warp * v.num_warps)
    by_smem = gpu.smem_per_sm // (v.shared_bytes + gpu.smem_reserved_per_block)
    by_warps = gpu.max_warps_per_sm // v.num_warps
    return min(by_regs, by_smem, by_warps, gpu.max_blocks_per_sm)


def estimate(fmt: str, m: int, n: int, k: int, v: Variant, group: int = 64, gpu: GPU = H100_SXM) -> dict | None:
    """The model's time for y[M, N] = x[M, K] @ W.T in `fmt` through variant `v`; None if it cannot launch."""
    bps = blocks_per_sm(v, gpu)
    if bps == 0:
        return None
    splits, iters = split(m, n, k, v.block_m, v.block_n, v.block_k) if v.split_k else (1, math.ceil(k / v.block_k))
    programs = math.ceil(m / v.block_m) * math.ceil(n / v.block_n) * splits
    busiest = math.ceil(programs / gpu.sms)  # programs on the busiest SM
    resident_warps = min(bps, busiest) * v.num_warps
    act = 2 * m * k + 2 * m * n
    partials = 2 * 4 * m * n * splits if splits > 1 else 0  # fp32 partial sums written, then read and added
    total_bytes = weight_bytes(fmt, n, k, group) + act + partials
    bounds = {
        "memory": total_bytes / (gpu.hbm_bytes_s * gpu.efficiency * min(1.0, gpu.sm_share * min(programs, gpu.sms)
                                                                        / gpu.sms)),
        "issue": busiest * iters * v.loop_instructions * v.num_warps
                 / (min(gpu.issue_per_clk, resident_warps) * gpu.clock_hz),
    }
    if v.mma != "none":  # the fp32 multiply-adds of the M = 1 kernels are in their instruction count
        bounds["tensor"] = busiest * 2 * v.block_m * v.block_n * v.block_k * iters / (
            gpu.tensor_flops / gpu.sms * (1.0 if v.mma == "hgmma" else gpu.hmma_fraction) * gpu.efficiency)
    limiter = max(bounds, key=bounds.get)
    return {"time_s": bounds[limiter], "limiter": limiter, "bounds_s": bounds, "bytes": total_bytes,
            "programs": programs, "splits": splits, "blocks_per_sm": bps,
            "waves": math.ceil(programs / (gpu.sms * bps))}


def bf16_reference(m: int, n: int, k: int, gpu: GPU = H100_SXM) -> dict:
    """cuBLAS bf16 idealised: max(bytes / bandwidth, FLOPs / peak), both at the model's efficiency."""
    total_bytes = 2 * n * k + 2 * m * k + 2 * m * n
    bounds = {"memory": total_bytes / (gpu.hbm_bytes_s * gpu.efficiency),
              "tensor": 2 * m * n * k / (gpu.tensor_flops * gpu.efficiency)}
    limiter = max(bounds, key=bounds.get)
    return {"time_s": bounds[limiter], "limiter": limiter, "bounds_s": bounds, "bytes": total_bytes}


def best(fmt: str, m: int, n: int, k: int, variants: dict[str, Variant], group: int = 64,
         gpu: GPU = H100_SXM) -> dict | None:
    """The fastest variant kernels.matmul may run at M by the model (what an ideal autotuner would pick), with
    its name; None if none fits."""
    route = next((r for r in routes(m) if any(v.route == r for v in variants.values())), None)
    found = [(name, e) for name, v in variants.items()
             if v.route == route and (e := estimate(fmt, m, n, k, v, group, gpu))]
    if not found:
        return None
    name, e = min(found, key=lambda t: t[1]["time_s"])
    return {"variant": name, **e}


def model_rows(variants: dict[str, dict[str, Variant]], group: int = 64, gpu: GPU = H100_SXM,
               layers: dict = LAYERS, tokens: tuple[int, ...] = TOKENS) -> list[dict]:
    """One row per (model, layer, M, format): the best variant's estimate and its speed-up over bf16 cuBLAS.
    `variants` maps format -> {variant name: Variant}."""
    rows = []
    for model, shapes in layers.items():
        for layer, k, n in shapes:
            for m in tokens:
                ref = bf16_reference(m, n, k, gpu)
                for fmt, vs in variants.items():
                    e = best(fmt, m, n, k, vs, group, gpu)
                    row = {"model": model, "layer": layer, "K": k, "N": n, "M": m, "format": fmt,
                           "bf16_cublas_us": ref["time_s"] * 1e6, "bf16_limiter": ref["limiter"]}
                    if e is None:
                        row["error"] = "no variant fits on the GPU"
                    else:
                        row.update(variant=e["variant"], time_us=e["time_s"] * 1e6, limiter=e["limiter"],
                                   bounds_us={b: t * 1e6 for b, t in e["bounds_s"].items()}, bytes=e["bytes"],
                                   programs=e["programs"], splits=e["splits"], blocks_per_sm=e["blocks_per_sm"],
                                   waves=e["waves"],
                                   speedup_vs_bf16=ref["time_s"] / e["time_s"])
                    rows.append(row)
    return rows


def gpu_record(gpu: GPU = H100_SXM) -> dict:
    return asdict(gpu)
