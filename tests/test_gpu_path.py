"""The calibration engine's GPU-only branches, run on CPU with torch.cuda's queries stood in (this machine has
no GPU; scripts/gpu_smoke.sh runs the real thing): bf16 only where the GPU has bf16 units, XᵀX's bf16 products
without bf16 split-K sums, a streamed run refused when the GPU's free memory cannot hold its footprint."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_config

from core.calibrate import CalibConfig, bf16_is_fast, run_blocks
from core.device import peak_device_memory_gib
from core.errors import SmeltError
from core.linear_stats import LinearStats
from models.llama import FLAVORS, build_model
from models.streamed import check_memory

GPU = torch.device("cuda", 0)


@pytest.mark.parametrize(("capability", "fast"), [((7, 0), False), ((7, 5), False), ((8, 0), True), ((9, 0), True)])
def test_bf16_forwards_only_on_gpus_with_bf16_units(monkeypatch, capability, fast):
    # torch.cuda.is_bf16_supported() says True on a V100 too (emulated), where bf16 forwards would be slow
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert bf16_is_fast(GPU) is fast


@pytest.mark.parametrize(("capability", "product"), [((7, 0), torch.float32), ((8, 0), torch.bfloat16)])
def test_auto_xtx_products_are_bf16_only_where_bf16_is_fast(monkeypatch, capability, product):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    cfg = CalibConfig(hessian="auto")
    assert cfg.hessian_dtype(GPU) == product
    assert cfg.hessian_dtype(torch.device("cpu")) == (torch.bfloat16 if bf16_is_fast(torch.device("cpu"))
                                                      else torch.float32)
    assert cfg.record(GPU)["hessian_dtype"] == str(product).removeprefix("torch.")
    cfg.check_dampening(0.01, GPU)
    if product == torch.bfloat16:  # what the products resolve to decides, not the setting's name
        with pytest.raises(SmeltError, match="hessian=auto needs percdamp > 0: its bf16 products"):
            cfg.check_dampening(0.0, GPU)
    else:
        cfg.check_dampening(0.0, GPU)  # fp32 products: the rank test judges H by fp32's epsilon


@pytest.mark.parametrize("hessian", ["bfloat16", "float32"])
def test_xtx_products_never_sum_split_k_partials_in_bf16_and_the_flag_comes_back(monkeypatch, hessian):
    matmul = torch.backends.cuda.matmul  # its settings are properties of torch's C side, not attributes
    before = matmul.allow_bf16_reduced_precision_reduction
    matmul.allow_bf16_reduced_precision_reduction = True
    seen = []
    add = LinearStats.add

    def spy(self, *args, **kw):
        seen.append(matmul.allow_bf16_reduced_precision_reduction)
        return add(self, *args, **kw)
    monkeypatch.setattr(LinearStats, "add", spy)
    model = build_model(tiny_config("debug-untied", max_seq_len=64), seed=0).eval()
    windows = torch.randint(0, 260, (4, 16), generator=torch.Generator().manual_seed(0))
    try:
        run_blocks(model, windows, lambda *a: None,
                   CalibConfig(n_windows=4, seq_len=16, batch_size=2, hessian=hessian), progress=False)
        assert seen and not any(seen)
        assert matmul.allow_bf16_reduced_precision_reduction is True  # the user's setting, restored
    finally:
        matmul.allow_bf16_reduced_precision_reduction = before


def test_a_streamed_run_the_gpu_cannot_hold_is_refused_in_one_line(monkeypatch):
    stream = SimpleNamespace(cfg=FLAVORS["smollm2-135m"], device=GPU)
    free = {"bytes": 100 << 20}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free["bytes"], 80 << 30))
    # within --max-memory, but more than the GPU has free: the limit alone does not bound GPU memory
    with pytest.raises(SmeltError, match=r"needs [0-9.]+ GiB on cuda:0, which has 0\.098 GiB free") as e:
        check_memory(stream, 64.0, 128, 512, 8, torch.bfloat16, hessian=True)
    assert "\n" not in str(e.value)
    free["bytes"] = 40 << 30
    need = check_memory(stream, 64.0, 128, 512, 8, torch.bfloat16, hessian=True)
    assert 100 / 1024 < need["footprint_gib"]["total"] < 40


def test_gpu_memory_is_recorded_only_for_a_gpu():
    assert peak_device_memory_gib(torch.device("cpu")) is None
