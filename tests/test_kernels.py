"""The kernels' layouts (core.packing) and Triton matmuls (kernels.matmul, in the interpreter on CPU), the
KernelLinear built from them, and a release run through the kernels against the fake-quantized model."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import make_qat_artifact

from core.errors import SmeltError
from core.packing import pack_24, pack_int4, unpack_24, unpack_24_positions, unpack_int4
from core.patterns import NMPattern
from core.release_layout import ReleaseLinear, read_release_linears
from kernels.linear import KernelLinear
from kernels.matmul import DEVICE, SMALL_M, sparse24_matmul, sparse24_w4a16_matmul, w4a16_matmul
from qat.quantizers import QuantSpec

TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # relative to max |y|
TOKENS = torch.tensor([[1, 72, 101, 108, 108, 111, 44, 32, 119, 2]])


def _w4(n: int, k: int, g: int, gen: torch.Generator):
    q = torch.randint(-8, 8, (n, k), generator=gen)
    scale = torch.rand(n, k // g, generator=gen) + 0.05
    return q, scale, q.float() * scale.repeat_interleave(g, dim=1)


def _keep24(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    return NMPattern(2, 4).keep_top(torch.rand(n, k, generator=gen))


def _on(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors on the kernels' device: the GPU where there is one (the compiled kernels), else the CPU
    (Triton's interpreter). The references stay on the CPU."""
    return tuple(t.to(DEVICE) for t in tensors)


def _logits(model: torch.nn.Module, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    """A model's logits computed on the kernels' device, returned on the CPU."""
    model = model.to(DEVICE)
    model.init_rope(DEVICE)
    with torch.no_grad():
        return model(tokens.to(DEVICE)).float().cpu()


def _close(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert y.dtype == dtype and y.shape == ref.shape and y.device.type == DEVICE.type
    err = (y.float().cpu() - ref).abs().max().item() / ref.abs().max().item()
    assert err <= TOL[dtype], err


def test_int4_packing_is_compressed_tensors_and_roundtrips():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    q = torch.randint(-8, 8, (5, 48))
    packed = pack_int4(q)
    assert packed.dtype == torch.int32 and packed.shape == (5, 6)
    assert torch.equal(packed, pack_to_int32(q.to(torch.int8), 4))
    assert torch.equal(unpack_int4(packed, 48), q.to(torch.int8))
    # input i at bits 4*(i%8), stored as q + 8; a top nibble >= 8 wraps the word negative (same bits)
    assert pack_int4(torch.tensor([[1, -8, 0, 0, 0, 0, 0, -1]])).item() == 0x7888_8809
    assert pack_int4(torch.tensor([[0, 0, 0, 0, 0, 0, 0, 7]])).item() == 0xF888_8888 - 2**32


def test_24_packing_layout_and_roundtrip():
    w = torch.zeros(1, 32)
    w[0, [1, 3]] = torch.tensor([5.0, 6.0])  # group 0 keeps positions 1, 3
    w[0, 6] = 7.0                           # group 1 keeps one: 2, plus the first free position 0 (value 0)
    values, meta = pack_24(w, w != 0)
    assert values[0, :4].tolist() == [5.0, 6.0, 0.0, 7.0]
    assert meta.dtype == torch.int32 and meta.shape == (1, 1)
    assert meta.item() & 0xFF == (1 | 3 << 2) | (0 | 2 << 2) << 4
    assert torch.equal(unpack_24(values, meta, 32), w)
    gen = torch.Generator().manual_seed(0)
    keep = _keep24(8, 64, gen)
    w = torch.randn(8, 64, generator=gen) * keep
    values, meta = pack_24(w, keep)
    assert values.shape == (8, 32) and meta.shape == (8, 2)
    assert torch.equal(unpack_24(values, meta, 64), w)
    q = torch.randint(-8, 8, (8, 64), generator=gen) * keep  # int codes pack the same way
    kept, meta = pack_24(q, keep)
    assert torch.equal(unpack_24(unpack_int4(pack_int4(kept), 32), meta, 64), q.to(torch.int8))


def test_24_packing_refuses_what_is_not_24():
    w = torch.zeros(1, 32)
    w[0, :3] = 1.0
    with pytest.raises(SmeltError, match="keeps more than 2"):
        pack_24(w, w != 0)
    keep = torch.zeros(1, 32, dtype=torch.bool)
    with pytest.raises(SmeltError, match="non-zero weights where the 2:4 mask drops them"):
        pack_24(w, keep)
    with pytest.raises(SmeltError, match="multiple of 32"):
        pack_24(torch.zeros(1, 16), torch.zeros(1, 16, dtype=torch.bool))
    bad = torch.tensor([[0x3 | 0x0 << 2]], dtype=torch.int32)  # slot 0 at 3, slot 1 at 0: not increasing
    with pytest.raises(SmeltError, match="not increasing"):
        unpack_24_positions(bad, 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,g", [(1, 48, 128, 64), (16, 33, 96, 32), (37, 64, 576, 64)])
def test_kernels_match_the_dequantized_reference(dtype, m, n, k, g):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen).to(dtype)
    xf = x.float()
    q, scale, w = _w4(n, k, g, gen)
    _close(w4a16_matmul(*_on(x, pack_int4(q), scale), g), xf @ w.T, dtype)

    keep = _keep24(n, k, gen)
    dense = torch.randn(n, k, generator=gen).to(dtype) * keep
    values, meta = pack_24(dense, keep)
    _close(sparse24_matmul(*_on(x, values, meta)), xf @ dense.float().T, dtype)

    q24 = q * keep
    kept, meta = pack_24(q24, keep)
    w24 = q24.float() * scale.repeat_interleave(g, dim=1)
    _close(sparse24_w4a16_matmul(*_on(x, pack_int4(kept), meta, scale), g), xf @ w24.T, dtype)


def test_kernels_refuse_bad_input_before_launch():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 64)
    q, scale, _ = _w4(16, 64, 32, gen)
    packed = pack_int4(q)
    with pytest.raises(SmeltError, match=r"packed weight must be int32 \[16, 16\].*got torch.int32 \[16, 8\]"):
        w4a16_matmul(torch.randn(2, 128), packed, scale, 32)
    with pytest.raises(SmeltError, match=r"scale must be float \[16, 1\]"):
        w4a16_matmul(x, packed, scale, 64)
    with pytest.raises(SmeltError, match="group_size 24 must divide"):
        w4a16_matmul(x, packed, scale, 24)
    with pytest.raises(SmeltError, match="x must be 2-D"):
        w4a16_matmul(x.to(torch.int32), packed, scale, 32)
    keep = _keep24(16, 64, gen)
    values, meta = pack_24(torch.randn(16, 64) * keep, keep)
    with pytest.raises(SmeltError, match=r"2:4 meta must be int32 \[16, 2\]"):
        sparse24_matmul(x, values, meta.to(torch.int64))
    with pytest.raises(SmeltError, match="weight values must be float"):
        sparse24_matmul(x, values[:, :16], meta)


def test_kernel_linear_runs_dense_rows_on_the_dense_path():
    gen = torch.Generator().manual_seed(3)
    n, k, g = 40, 64, 32
    q, scale, _ = _w4(n, k, g, gen)
    keep = _keep24(n, k, gen)
    dense_rows = torch.zeros(n, dtype=torch.bool)
    dense_rows[8:16] = True
    keep[dense_rows] = True  # protected rows keep everything
    q = q * keep
    lin = ReleaseLinear("m", (n, k), g, scale, packed=pack_int4(q), keep=keep, dense_rows=dense_rows)
    mod = KernelLinear.from_release(lin).to(DEVICE)
    assert mod.kind == "2:4+w4" and "dense rows" in repr(mod)
    x = torch.randn(3, 5, k, generator=gen)
    _close(mod(*_on(x)), x @ lin.weight().T, torch.float32)
    w = torch.randn(n, k, generator=gen) * keep  # the unquantized 2:4 module: dense rows in plain torch
    _close(KernelLinear.from_pruned(w, keep, dense_rows).to(DEVICE)(*_on(x)), x @ w.T, torch.float32)
    keep[0, :3] = True  # a row outside the declared dense rows that breaks 2:4
    with pytest.raises(SmeltError, match="keeps more than 2"):
        KernelLinear.from_release(ReleaseLinear("m", (n, k), g, scale, packed=pack_int4(q), keep=keep,
                                                dense_rows=dense_rows))


def test_large_m_bf16_24_goes_to_cusparselt_built_once_from_the_stored_values(monkeypatch):
    """Past decode-sized M on a GPU, bf16/fp16 2:4 runs PyTorch's semi-structured matmul (its sparse tensor
    cores); here the GPU and the semi-structured tensor are stood in for, the routing and the weight are real."""
    import kernels.linear as kl

    v, x16 = torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(1, 8, dtype=torch.bfloat16)
    on_gpu = lambda t: type("T", (), {"device": torch.device("cuda"), "dtype": t.dtype})()
    assert kl.uses_cusparselt(SMALL_M + 1, on_gpu(x16), v) and not kl.uses_cusparselt(SMALL_M, on_gpu(x16), v)
    assert not kl.uses_cusparselt(SMALL_M + 1, x16, v)  # CPU: the interpreter's kernel
    assert not kl.uses_cusparselt(SMALL_M + 1, on_gpu(x16.float()), v.float())  # fp32: no sparse tensor cores

    gen = torch.Generator().manual_seed(5)
    n, k = 24, 64
    keep = _keep24(n, k, gen)
    w = (torch.randn(n, k, generator=gen) * keep).to(torch.bfloat16)
    built = []
    monkeypatch.setattr(kl, "uses_cusparselt", lambda m, x, values: m > SMALL_M)
    monkeypatch.setattr(kl, "semi_structured", lambda dense: built.append(dense) or dense)
    mod = KernelLinear.from_pruned(w, keep).to(DEVICE)
    x = torch.randn(SMALL_M + 3, k, generator=gen).to(torch.bfloat16)
    for _ in range(2):
        _close(mod(*_on(x)), x.float() @ w.float().T, torch.bfloat16)
    assert len(built) == 1 and torch.equal(built[0].cpu(), w)  # once, from the stored values and metadata
    monkeypatch.setattr(kl, "semi_structured", lambda dense: (_ for _ in ()).throw(RuntimeError("shape")))
    mod = KernelLinear.from_pruned(w, keep).to(DEVICE)
    _close(mod(*_on(x)), x.float() @ w.float().T, torch.bfloat16)  # refused: the Triton tile runs
    assert mod._semi is False


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    from qat.release import build_release

    root = tmp_path_factory.mktemp("kart")
    art, ref = make_qat_artifact(root, QuantSpec(group_size=32), [("1", 2)], TOKENS)
    return build_release(art, root / "release", dtype="float32"), ref


def test_release_runs_through_the_kernels_like_the_fake_quantized_model(release):
    from kernels.release_model import dense_reference, kernel_model

    rel, ref = release
    model = kernel_model(rel)
    kinds = {m.kind for m in model.modules() if isinstance(m, KernelLinear)}
    assert kinds == {"2:4+w4"}  # every Linear of the tiny release is 2:4 + W4
    assert not any(isinstance(m, torch.nn.Linear) and m is not model.output for m in model.modules())
    got = _logits(model)
    with torch.no_grad():
        dense = dense_reference(rel)(TOKENS)
    assert (got - ref).abs().max().item() <= 1e-4
    assert (got - dense).abs().max().item() <= 1e-4
    linears = read_release_linears(rel)
    assert sum(lin.dense_rows is not None for lin in linears.values()) == 3  # q/k/v of the protected head
    two = kernel_model(rel, layers=1)
    assert len(two.layers) == 1
    with pytest.raises(SmeltError, match="--layers 9"):
        kernel_model(rel, layers=9)


def test_compressed_storage_is_smaller_verifies_runs_and_expands_to_the_same_weights(release, tmp_path, capsys):
    from kernels.release_model import kernel_model
    from qat.release import build_release, expand_release
    from qat.verify import verify_release

    rel, ref = release
    art = rel.parent / "qat"
    comp = build_release(art, tmp_path / "comp", dtype="float32", sparse_storage="compressed")
    assert not (comp / "sparsity.safetensors").exists()
    size = lambda d: sum(p.stat().st_size for p in d.iterdir())  # noqa: E731
    assert size(comp) < size(rel)
    report = verify_release(comp)
    assert not report.failures, report.lines
    assert any("--expand converts" in line for line in report.lines)
    assert (_logits(kernel_model(comp)) - ref).abs().max().item() <= 1e-4
    mask_lin, comp_lin = read_release_linears(rel), read_release_linears(comp)
    for name, lin in mask_lin.items():
        assert torch.equal(comp_lin[name].codes(), lin.codes()), name
    back = expand_release(comp, tmp_path / "back")
    assert not verify_release(back).failures
    for name, lin in read_release_linears(back).items():
        assert torch.equal(lin.packed, mask_lin[name].packed), name
    with pytest.raises(SmeltError, match="not a release in the compressed 2:4 storage"):
        expand_release(rel, tmp_path / "again")


def test_release_ships_unquantized_tensors_in_the_serving_dtype(release, tmp_path):
    from safetensors import safe_open

    from qat.release import build_release
    from qat.verify import verify_release

    rel, _ = release
    bf = build_release(rel.parent / "qat", tmp_path / "bf16")  # the default
    with safe_open(str(bf / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
        assert f.get_tensor("model.norm.weight").dtype == torch.bfloat16
    with safe_open(str(bf / "mtp.safetensors"), framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}  # noqa: SIM118
    assert json.loads((bf / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert (bf / "model.safetensors").stat().st_size < (rel / "model.safetensors").stat().st_size
    report = verify_release(bf)  # incl. the MTP acceptance, recorded with the shipped bf16 values
    assert not report.failures, report.lines


def test_check_command_passes_on_a_release_and_bench_needs_a_gpu(release, tmp_path, capsys):
    from core.errors import run_cli
    from kernels import bench, check

    rel, _ = release
    with pytest.raises(SystemExit) as e:
        run_cli(lambda: check.main([str(rel), "--tokens", "16", "--out", str(tmp_path / "c.json")]))
    assert e.value.code == 0
    res = json.loads((tmp_path / "c.json").read_text())
    assert res["passed"] and res["top1_agree"] == 1.0 and res["kernel_linears"] == {"2:4+w4": 14}
    assert "PASSED" in capsys.readouterr().out
    art = rel.parent / "qat"  # its masks are 2:4: as a pruned artifact, the 2:4 kernel runs its values
    with pytest.raises(SystemExit) as e:
        run_cli(lambda: check.main([str(art), "--tokens", "16", "--layers", "1", "--out", str(tmp_path / "p.json")]))
    res = json.loads((tmp_path / "p.json").read_text())
    assert e.value.code == 0 and res["kernel_linears"] == {"2:4": 7} and res["layers"] == 1
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as e:
            run_cli(lambda: bench.main([]))
        assert e.value.code != 0 and "needs a CUDA GPU" in capsys.readouterr().err


def test_verify_names_a_missing_compressed_tensor(release, tmp_path):
    from safetensors.torch import load_file, save_file

    from qat.release import build_release
    from qat.verify import verify_release

    rel, _ = release
    comp = build_release(rel.parent / "qat", tmp_path / "comp", dtype="float32", sparse_storage="compressed")
    tensors = load_file(str(comp / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj"
    del tensors[f"{name}.weight_meta"]
    save_file(tensors, str(comp / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(SmeltError, match=rf"{name}\.weight_meta is missing, want int32"):
        read_release_linears(comp)
    report = verify_release(comp, load=False)
    assert any(f"{name}.weight_meta is missing" in line for line in report.failures), report.lines
