"""kernels.inspect compiles the Triton matmuls for sm_90 without a GPU and reads the result; kernels.roofline is
the model on top, checked on its own arithmetic."""
from __future__ import annotations

import pytest

from core.errors import SmeltError
from kernels import roofline
from kernels.inspect import TILE_CONFIGS, inspect_all, main, render_tables

SMALL = roofline.Variant(block_m=16, block_n=64, block_k=128, num_warps=4, registers=128, shared_bytes=64 * 1024,
                         loop_instructions=0, mma="hmma", route="m1")


def test_the_w4_tile_compiles_offline_for_sm90_in_storage_order_within_the_static_targets():
    large = next(i for i, c in enumerate(TILE_CONFIGS) if c[0] == "large 0")
    (r,) = inspect_all(["w4"], [large], [90], jobs=1, progress=False)
    assert "error" not in r, r.get("error")
    assert r["registers"] > 0 and r["fits_block"] and r["shared_bytes"] <= 100 * 1024
    assert r["spill_store_bytes"] == 0 and r["spill_load_bytes"] == 0
    assert r["mma_instruction"].startswith("HGMMA")
    # the packed words 16 bytes at a time and once, one scale per row and K block, the activations once
    assert set(r["streams"]["weights"]["loads"]) == {"async 16B"}
    for stream in ("weights", "scales", "activations"):
        assert r["streams"][stream]["reread"] == pytest.approx(1.0), stream
    assert 0 < r["instructions_per_weight"] <= 4.0
    # the autotuner's shared-memory estimate prunes only what cannot fit: never below the compiler's number
    assert r["shared_bytes"] <= r["shared_bytes_estimate"] <= 1.3 * r["shared_bytes"]
    assert r["specialisation"]["constexpr"]["stride_xk"] == 1 and "K" in r["specialisation"]["divisible_by_16"]
    assert "W4A16" in render_tables({"variants": [r]})


def test_the_w4_decode_kernel_compiles_without_mma_vector_loads_and_no_spills():
    (r,) = inspect_all(["w4-decode"], [], [90], jobs=1, progress=False)[:1]
    assert "error" not in r, r.get("error")
    assert r["M"] == 1 and r["mma_instruction"] == "none (FMA)" and r["loop"]["instructions"] > 0
    assert r["spill_store_bytes"] == 0 and r["fits_block"]
    # each packed word loaded once, 16 bytes at a time; one scale per row and K block
    assert r["streams"]["weights"]["reread"] == pytest.approx(1.0)
    assert set(r["streams"]["weights"]["loads"]) == {"ld 16B"}
    assert r["streams"]["scales"]["reread"] == pytest.approx(1.0)
    assert "W4A16 M=1" in render_tables({"variants": [r]})


def test_w4_at_decode_is_memory_bound_and_beats_bf16_by_its_bytes():
    m, n, k = 1, 14336, 4096
    e = roofline.estimate("w4", m, n, k, SMALL, group=64)
    ref = roofline.bf16_reference(m, n, k)
    assert e["limiter"] == "memory" and ref["limiter"] == "memory"
    assert e["bounds_s"]["issue"] == 0
    bytes_w4 = n * k / 2 + 2 * n * k / 64 + 2 * (m * k + m * n)
    assert e["bytes"] == bytes_w4
    assert ref["time_s"] / e["time_s"] == pytest.approx((2 * n * k + 2 * (m * k + m * n)) / bytes_w4)
    assert roofline.weight_bytes("24w4", n, k, 64) < roofline.weight_bytes("w4", n, k, 64) \
        < roofline.weight_bytes("24", n, k, 64) < roofline.weight_bytes("bf16", n, k, 64)


def test_instruction_issue_and_waves_bound_the_estimate():
    heavy = roofline.Variant(**{**SMALL.__dict__, "loop_instructions": 2000})
    m, n, k = 1, 14336, 4096
    e = roofline.estimate("w4", m, n, k, heavy)
    programs = n // 64
    assert e["programs"] == programs and e["limiter"] == "issue"
    busiest = -(-programs // 132)  # 224 programs on 132 SMs: two on the busiest
    assert e["bounds_s"]["issue"] == pytest.approx(busiest * (k // 128) * 2000 * 4 / (4 * 1.755e9))
    assert e["time_s"] == max(e["bounds_s"].values())
    # an over-large shared memory request cannot launch; the best pick skips it
    too_big = roofline.Variant(**{**SMALL.__dict__, "shared_bytes": 300 * 1024})
    assert roofline.blocks_per_sm(too_big) == 0 and roofline.estimate("w4", m, n, k, too_big) is None
    assert roofline.best("w4", m, n, k, {"a": too_big, "b": heavy})["variant"] == "b"
    # prefill: the bf16 reference turns compute-bound
    assert roofline.bf16_reference(2048, n, k)["limiter"] == "tensor"


def test_split_k_fills_the_gpu_and_pays_for_its_partial_sums():
    split_v = roofline.Variant(**{**SMALL.__dict__, "block_m": 64, "block_n": 256, "block_k": 64, "mma": "hgmma",
                                  "route": "small", "split_k": True})
    m, n, k = 16, 4096, 4096
    e = roofline.estimate("w4", m, n, k, split_v)
    splits = e["splits"]
    assert splits > 1 and e["programs"] == (n // 256) * splits
    assert e["bytes"] == roofline.weight_bytes("w4", n, k, 64) + 2 * (m * k + m * n) + 8 * m * n * splits
    # a grid of few programs cannot draw the whole HBM bandwidth
    few = roofline.estimate("w4", m, 1024, k, split_v)
    assert few["programs"] < 132 and few["bounds_s"]["memory"] > roofline.weight_bytes("w4", 1024, k, 64) / (
        3.35e12 * 0.8)
    # M = 1 goes to the M = 1 kernel where there is one, else to the small tile
    assert roofline.routes(1) == ("m1", "small") and roofline.routes(64) == ("small",) \
        and roofline.routes(65) == ("large",)
    assert roofline.best("w4", 1, n, k, {"tile": split_v})["variant"] == "tile"


def test_occupancy_counts_registers_shared_memory_and_warps():
    assert roofline.blocks_per_sm(SMALL) == 3  # 228 KB / (64 + 1) KB; registers allow 4
    assert roofline.blocks_per_sm(roofline.Variant(**{**SMALL.__dict__, "registers": 255})) == 2
    assert roofline.blocks_per_sm(roofline.Variant(**{**SMALL.__dict__, "shared_bytes": 0})) == 4


@pytest.mark.parametrize("args,text", [(["--configs", "9"], "--configs"), (["--formats", "w8"], "--formats"),
                                       (["--arch", "75"], "--arch"), (["--jobs", "0"], "--jobs")])
def test_bad_arguments_are_one_line_before_compiling(args, text, tmp_path):
    with pytest.raises(SmeltError, match=text):
        main([*args, "--out", str(tmp_path / "x.json")])


def test_the_docs_table_is_the_committed_json_rendered():
    """docs/kernels.md shows `python -m kernels.inspect --table` of results/kernels/inspect.json, not a copy that
    went stale when the JSON was measured again."""
    import json

    from conftest import ROOT

    from kernels.inspect import render_tables

    doc = (ROOT / "docs" / "kernels.md").read_text()
    begin, end = "<!-- python -m kernels.inspect --table -->", "<!-- /python -m kernels.inspect --table -->"
    shown = doc[doc.index(begin) + len(begin):doc.index(end)].strip()
    report = json.loads((ROOT / "results" / "kernels" / "inspect.json").read_text())
    assert shown == render_tables(report).strip(), "run `python -m kernels.inspect --table` and paste it"


def test_the_committed_report_meets_the_speed_and_resource_targets():
    """results/kernels/inspect.json (sm_90, Llama-3.1-8B): every release format's config without spills and
    within 100 KB of shared memory; by the model, W4 >= 2.5x bf16 at M = 1 and >= 2.0x at M = 16, 2:4 + W4
    >= 3.2x and >= 2.6x, and no format under 0.9x at M = 2048, on every projection."""
    import json

    from conftest import ROOT

    report = json.loads((ROOT / "results" / "kernels" / "inspect.json").read_text())
    for v in report["variants"]:
        if v["arch"] == 90 and not v["format"].startswith("bf16"):
            assert v["spill_store_bytes"] == 0 and v["shared_bytes"] <= 100 * 1024, (v["format"], v["name"])
    floor = {("w4", 1): 2.5, ("w4", 16): 2.0, ("24w4", 1): 3.2, ("24w4", 16): 2.6}
    rows = [r for r in report["model"]["rows"] if r["model"] == "llama-3.1-8b" and r["format"] != "bf16"]
    assert len(rows) == 9 * 3 * 3
    for r in rows:
        need = 0.9 if r["M"] == 2048 else floor.get((r["format"], r["M"]), 0)
        assert r["speedup_vs_bf16"] >= need, (r["layer"], r["M"], r["format"], r["speedup_vs_bf16"])
