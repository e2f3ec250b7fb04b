"""Where work runs and what it runs on: device selection, process memory, the machine record that
every committed result carries (a number moves with the CPU, thread count and torch build)."""
from __future__ import annotations

import ctypes
import gc
import os
import platform
import resource
import time

import torch


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def bf16_is_fast(device: torch.device) -> bool:
    """bf16 matmuls run on dedicated units: a CUDA GPU (Ampere+), or a CPU with AMX / avx512-bf16."""
    if device.type == "cuda":  # Ampere and later (is_bf16_supported() also counts emulation)
        return torch.cuda.get_device_capability(device)[0] >= 8
    if device.type != "cpu":
        return False
    try:
        flags = open("/proc/cpuinfo").read()  # Linux; elsewhere fall back to torch's capability string
    except OSError:
        flags = str(torch.backends.cpu.get_cpu_capability()).lower()
    return "amx_bf16" in flags or "avx512_bf16" in flags


def peak_rss_gib() -> float:
    """Peak resident memory of this process so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def release_memory() -> None:
    """Hand freed memory back: glibc's heap pages to the OS (it keeps the many mid-sized buffers a
    calibration frees, hundreds of MB on a 135M model, which would add to a later stage's peak RSS), and the
    CUDA caching allocator's blocks to the driver (an evaluation in a child process needs them)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass
    if _cuda_in_use():
        gc.collect()  # tensors in reference cycles still hold their blocks
        torch.cuda.empty_cache()


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def synchronize() -> None:
    """Wait for queued GPU work (a no-op on CPU), so a phase's timer does not stop before its kernels ran."""
    if _cuda_in_use():
        torch.cuda.synchronize()


def peak_device_memory_gib(device: torch.device) -> float | None:
    """Peak GPU memory this process's tensors held (None on CPU, where peak_rss_gib covers it)."""
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def interleaved_seconds(cases: dict, repeats: int) -> tuple[dict[str, list[float]], dict]:
    """Wall seconds of each zero-argument callable in `cases`, `repeats` rounds of one call each in turn (so
    drift in the machine's speed hits every case alike), and each case's last return value."""
    times, outs = {name: [] for name in cases}, {}
    for _ in range(repeats):
        for name, fn in cases.items():
            t = time.perf_counter()
            outs[name] = fn()
            times[name].append(time.perf_counter() - t)
    return times, outs


def machine_record() -> dict:
    """CPU model, cores and threads, torch build and accelerator: stored next to every measured number."""
    rec = {"cpu": _cpu_model(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
           "torch": torch.__version__, "torch_cuda": torch.version.cuda, "python": platform.python_version(),
           "platform": platform.platform()}
    if torch.cuda.is_available():
        rec["gpu"] = torch.cuda.get_device_name(0)
    return rec


def return_freed_memory_at_once(threshold: int = 1 << 17) -> None:
    """Have glibc serve every allocation above `threshold` bytes with its own mmap, unmapped when freed.
    A streamed calibration frees each block's activations and statistics before the next block's: with a
    high threshold these stay in glibc's heap (SmolLM2, 128 windows: 0.887 GiB of growth at 32 MiB against
    0.442 GiB at 128 KiB; docs/performance.md)."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, threshold)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass
