"""The few patches torchtitan 0.3.0 needs to train on a machine with no accelerator (CPU + gloo).

Applied by `train.run` and `train.launch` only when no CUDA device is present, and before torchtitan
is imported (it reads the device type at import time). Each patch says what fails without it. Gloo's
lack of PREMUL_SUM/AVG reductions is handled where FSDP is applied (train.titan.parallelize), not here.
"""
from __future__ import annotations

import os
import types

import torch
import torch._utils as tu

from core.device import peak_rss_gib

_applied = False


def needed() -> bool:
    return not torch.cuda.is_available()


def apply() -> None:
    global _applied
    if _applied or not needed():
        return
    _applied = True
    # 1. torchtitan.tools.utils sets device_type = _get_available_device_type() or "cuda": on a CUDA
    #    build with no GPU that is "cuda", and Trainer then calls torch.cuda.set_device. With "cpu"
    #    the process group uses gloo and the mesh/init device is the CPU.
    orig = tu._get_available_device_type
    tu._get_available_device_type = lambda: "cpu"
    try:
        import torchtitan.tools.utils as tt_utils  # here, not at the top: it must see the patch above
    finally:
        tu._get_available_device_type = orig
    assert tt_utils.device_type == "cpu"

    # 2. DeviceMemoryMonitor calls the CUDA memory API on torch.cpu, which lacks it. Its log line's
    #    "memory:" figure (reserved_bytes.all.peak) is then the process's peak RSS since it started
    #    (ru_maxrss cannot be reset); without the keys it would print -0.00GiB.
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    props = types.SimpleNamespace(total_memory=total, name="cpu")
    for name, fn in {"get_device_name": lambda device=None: "cpu",
                     "get_device_properties": lambda device=None: props,
                     "reset_peak_memory_stats": lambda device=None: None,
                     "empty_cache": lambda: None,
                     "memory_stats": _memory_stats}.items():
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, fn)

    # 3. set_pg_timeouts calls dist.barrier(device_ids=[device_module.current_device()]); on CPU that is
    #    the string "cpu", which BarrierOptions rejects. Give torchtitan an integer index (gloo: cpu:0).
    import torchtitan.distributed.utils as du  # after torchtitan.tools.utils read the patched device type

    class _CpuDeviceModule(types.ModuleType):
        def __getattr__(self, name):
            return getattr(torch.cpu, name)

        @staticmethod
        def current_device():
            return 0

    du.device_module = _CpuDeviceModule("torch_cpu_int_index")


def _memory_stats(device=None) -> dict[str, int]:
    """The keys torchtitan's DeviceMemoryMonitor reads, from this process's peak RSS."""
    peak = int(peak_rss_gib() * 2**30)
    return {"active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak, "num_alloc_retries": 0,
            "num_ooms": 0}
