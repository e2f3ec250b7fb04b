"""QAT maths: quantisers (vs compressed-tensors), GPTQ, fake-quant modules and the model swap."""
from __future__ import annotations

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize
from compressed_tensors.quantization.lifecycle.forward import fake_quantize as ct_fake_quantize
from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
from compressed_tensors.quantization.utils import calculate_qparams as ct_calculate_qparams
from conftest import tiny_config

from core.errors import SmeltError
from core.patterns import NMPattern
from models.llama import build_model, linear_names
from qat.fake_quant import FakeQuantConfig, FakeQuantLinear, freeze, init_scales, swap_to_fake_quant
from qat.gptq import gptq_quantize
from qat.quantizers import QuantSpec, check_group, compute_qparams, dequantize, fake_quantize, quantize, rtn


def _weight(out=32, inn=256, seed=0, outliers=True):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(out, inn, generator=g) * 0.02
    if outliers:  # a few large weights per row, as in real LLM layers
        idx = torch.randint(0, inn, (out, 2), generator=g)
        W.scatter_(1, idx, torch.randn(out, 2, generator=g) * 0.2)
    return W


def _calibration(inn=256, n=2048, seed=0):
    """Correlated inputs with uneven feature scales: where GPTQ's error compensation pays off."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(inn, inn, generator=g) / inn ** 0.5
    X = torch.randn(n, inn, generator=g) @ mix + 0.1 * torch.randn(n, inn, generator=g)
    return X * torch.rand(inn, generator=g).mul(3).exp()


def _linear(inn, out):
    return torch.nn.Linear(inn, out, bias=False)


def _mse(y, t):
    return (y - t).pow(2).mean()


def _out_err(X, W, Wq):
    return float((X @ (W - Wq).T).norm())


@pytest.mark.parametrize("spec", [QuantSpec(), QuantSpec(symmetric=False), QuantSpec(group_size=-1),
                                  QuantSpec(bits=8, group_size=32)], ids=["sym-g64", "asym-g64", "sym-chan", "int8"])
def test_matches_compressed_tensors_exactly(spec):
    W = _weight(inn=128)
    ct = QuantizationArgs(**spec.ct_args())
    lo_hi = W.reshape(W.shape[0], spec.n_groups(128), -1)
    ct_scale, ct_zp = ct_calculate_qparams(lo_hi.amin(-1), lo_hi.amax(-1), ct)
    scale, zp = compute_qparams(W, spec)
    assert torch.equal(scale, ct_scale)
    if spec.symmetric:
        assert zp is None and not ct_zp.any()
    else:
        assert torch.equal(zp, ct_zp)
    q = quantize(W, scale, zp, spec)
    ct_q = ct_quantize(W, ct_scale, ct_zp, ct, dtype=torch.int8)
    assert q.dtype == torch.int8 and torch.equal(q, ct_q)
    assert torch.equal(dequantize(q, scale, zp, spec), ct_dequantize(ct_q, ct_scale, ct_zp, ct))
    assert torch.equal(fake_quantize(W, scale, zp, spec), ct_fake_quantize(W, ct_scale, ct_zp, ct))


def test_symmetric_int4_round_trip():
    spec = QuantSpec(bits=4, symmetric=True, group_size=64)
    W = _weight(inn=256)
    scale, zp = compute_qparams(W, spec)
    assert scale.shape == (32, 4) and zp is None
    q = quantize(W, scale, zp, spec)
    assert int(q.min()) >= -8 and int(q.max()) <= 7 and int(q.min()) == -8  # the full int4 range is used
    err = (dequantize(q, scale, zp, spec) - W).abs().reshape(32, 4, 64)
    # minmax puts every weight inside [-7.5, 7.5] steps; +7.5 clamps to 7, so the error is <= half a step
    assert bool((err <= scale[..., None] / 2 * (1 + 1e-5)).all())  # 1e-5: fp32 rounding of W - q*s
    assert bool((fake_quantize(torch.zeros_like(W), scale, zp, spec) == 0).all())  # zero is exact


def test_bad_settings_are_refused():
    with pytest.raises(SmeltError, match="group_size=128 does not divide in_features=576 of layers.0.wq"):
        check_group(576, 128, "layers.0.wq")
    with pytest.raises(SmeltError, match="group_size=48 does not divide in_features=100"):
        compute_qparams(torch.randn(4, 100), QuantSpec(group_size=48))
    with pytest.raises(SmeltError, match="bits=3"):
        QuantSpec(bits=3)
    with pytest.raises(SmeltError, match="scale_init"):
        QuantSpec(scale_init="percentile")
    assert QuantSpec(group_size=-1).group_size is None
    check_group(576, 64)  # divides: fine


@pytest.mark.parametrize("symmetric", [True, False])
def test_mse_scales_beat_minmax_on_outliers(symmetric):
    W = _weight(out=64, inn=256, seed=3)
    errs = {}
    for init in ("minmax", "mse"):
        spec = QuantSpec(symmetric=symmetric, scale_init=init)
        errs[init] = (rtn(W, spec)[0] - W).pow(2).reshape(64, 4, 64).sum(-1)
    assert bool((errs["mse"] <= errs["minmax"]).all())  # per group, never worse
    # clipping helps less in asymmetric mode, whose range already hugs the data on both sides
    assert float(errs["mse"].sum()) < (0.95 if symmetric else 0.98) * float(errs["minmax"].sum())


@pytest.mark.parametrize("spec", [QuantSpec(), QuantSpec(symmetric=False), QuantSpec(group_size=None)],
                         ids=["sym-g64", "asym-g64", "sym-chan"])
def test_gptq_beats_rtn_on_layer_output(spec):
    ratios = []
    for seed in range(3):
        X, W = _calibration(seed=seed), _weight(seed=seed)
        Wq, scale, zp = gptq_quantize(W, X.T @ X, spec)
        assert torch.equal(fake_quantize(Wq, scale, zp, spec), Wq)  # on its own grid: exports losslessly
        ratios.append(_out_err(X, W, Wq) / _out_err(X, W, rtn(W, spec)[0]))
    assert max(ratios) < 1.0 and sum(ratios) / len(ratios) < 0.85


def test_gptq_act_order_keeps_contiguous_groups():
    spec = QuantSpec(group_size=64)
    for seed in range(2):
        X, W = _calibration(seed=seed), _weight(seed=seed)
        H = X.T @ X
        Wq, scale, zp = gptq_quantize(W, H, spec, act_order=True)
        assert scale.shape == (32, 4)
        # static groups: qparams are the contiguous groups of the original weight, and every output
        # weight lies on its contiguous group's grid, so plain group-wise export (no g_idx) reproduces it
        assert torch.equal(scale, compute_qparams(W, spec)[0])
        assert torch.equal(dequantize(quantize(Wq, scale, zp, spec), scale, zp, spec), Wq)
        plain = gptq_quantize(W, H, spec)[0]
        assert _out_err(X, W, Wq) < _out_err(X, W, rtn(W, spec)[0])
        assert _out_err(X, W, Wq) < 1.05 * _out_err(X, W, plain)
    with pytest.raises(SmeltError, match="non-contiguous"):
        gptq_quantize(W, H, spec, act_order=True, static_groups=False)


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("symmetric", [True, False])
def test_gptq_keeps_a_2_4_mask(act_order, symmetric):
    spec = QuantSpec(symmetric=symmetric)
    X, W = _calibration(seed=1), _weight(seed=1)
    mask = NMPattern(2, 4).keep_top(W.abs())
    Ws = W * mask
    Wq, scale, zp = gptq_quantize(Ws, X.T @ X, spec, mask=mask, act_order=act_order)
    assert bool((Wq[~mask] == 0).all()) and NMPattern(2, 4).holds(Wq)
    assert torch.equal(fake_quantize(Wq, scale, zp, spec), Wq)
    assert _out_err(X, Ws, Wq) < _out_err(X, Ws, rtn(Ws, spec)[0])


@pytest.mark.parametrize("spec", [QuantSpec(), QuantSpec(symmetric=False, scale_init="mse")], ids=["sym", "asym"])
def test_ste_and_lsq_gradients(spec):
    torch.manual_seed(0)
    x = torch.randn(8, 128)
    ste = FakeQuantLinear.from_linear(_linear(128, 16), spec)
    w_hat = ste.quantized_weight()
    assert torch.equal(w_hat, fake_quantize(ste.weight.detach(), ste.weight_scale, ste.weight_zero_point, spec))
    target = torch.randn(8, 16)
    w_hat.retain_grad()
    _mse(x @ w_hat.T, target).backward()
    assert torch.equal(ste.weight.grad, w_hat.grad)  # straight through

    lsq = FakeQuantLinear.from_linear(_linear(128, 16), spec, learn_scale=True)
    assert isinstance(lsq.weight_scale, torch.nn.Parameter)
    assert torch.equal(lsq.quantized_weight(), fake_quantize(lsq.weight.detach(), lsq.weight_scale.detach(),
                                                             lsq.weight_zero_point, spec))
    _mse(lsq(x), target).backward()
    g = lsq.weight_scale.grad
    assert g is not None and bool(torch.isfinite(g).all()) and bool(g.abs().sum() > 0)
    assert lsq.weight.grad is not None and bool(torch.isfinite(lsq.weight.grad).all())


def test_fake_quant_mask_keeps_zeros():
    lin = FakeQuantLinear.from_linear(_linear(64, 8), QuantSpec(group_size=32))
    mask = NMPattern(2, 4).keep_top(lin.weight.detach().abs())
    with torch.no_grad():  # what the trainer's MaskSet does after every step
        lin.weight.mul_(mask)
    lin.init_scales()
    assert bool((lin.quantized_weight()[~mask] == 0).all())
    q, _, _ = freeze(torch.nn.Sequential(lin))["0"]
    assert bool((q[~mask] == 0).all())


def test_swap_to_fake_quant_on_tiny_transformer():
    spec = QuantSpec(group_size=32)
    model = build_model(tiny_config(), seed=1)
    reference = build_model(tiny_config(), seed=1)
    names = swap_to_fake_quant(model, spec)
    assert names == linear_names(reference) and "output" not in names
    params = dict(model.named_parameters())
    assert "layers.0.attention.wq.weight" in params and "layers.0.attention.wq.weight_scale" not in params
    assert set(params) == set(dict(reference.named_parameters()))  # fixed scales are buffers
    assert "layers.0.attention.wq.weight_scale" in model.state_dict()
    assert type(model.output) is torch.nn.Linear and type(model.tok_embeddings) is torch.nn.Embedding
    assert isinstance(model.layers["0"].feed_forward.w2, FakeQuantLinear)

    with torch.no_grad():
        for name in names:
            lin = reference.get_submodule(name)
            lin.weight.copy_(rtn(lin.weight, spec)[0])
    tokens = torch.randint(0, 260, (2, 16))
    with torch.no_grad():
        assert torch.equal(model(tokens), reference(tokens))
    frozen = freeze(model)
    assert set(frozen) == set(names)
    q, scale, zp = frozen["layers.0.attention.wq"]
    assert q.dtype == torch.int8 and scale.shape == (64, 2) and zp is None
    assert torch.equal(dequantize(q, scale, zp, spec), reference.get_submodule("layers.0.attention.wq").weight)
    with pytest.raises(SmeltError, match="already fake-quantised"):
        swap_to_fake_quant(model, spec)
    with pytest.raises(SmeltError, match="group_size=48 does not divide in_features=64 of layers.0"):
        swap_to_fake_quant(build_model(tiny_config(), seed=1), QuantSpec(group_size=48))


def test_swap_on_meta_device_then_init_scales():
    spec = QuantSpec(group_size=32)
    model = build_model(tiny_config(), device="meta")
    names = swap_to_fake_quant(model, spec, learn_scale=True)
    wq = model.get_submodule("layers.0.attention.wq")
    assert wq.weight.is_meta and wq.weight_scale.is_meta
    assert "layers.0.attention.wq.weight_scale" in dict(model.named_parameters())
    with pytest.raises(SmeltError, match="materialise"):
        wq.init_scales()
    model = model.to_empty(device="cpu")
    model.init_weights(seed=1)
    assert init_scales(model) == names
    wq = model.get_submodule("layers.0.attention.wq")
    assert torch.equal(wq.weight_scale.detach(), compute_qparams(wq.weight.detach(), spec)[0])
    assert bool(torch.isfinite(model(torch.randint(0, 260, (1, 8)))).all())


def test_skip_entries_select_modules_and_typos_are_errors():
    spec = QuantSpec(group_size=32)
    model = build_model(tiny_config(), seed=1)
    names = swap_to_fake_quant(model, spec, skip=("output", "layers.1", "feed_forward.w2"))
    assert "layers.0.attention.wq" in names and "layers.0.feed_forward.w1" in names
    assert not any(n.startswith("layers.1.") or n.endswith("w2") or n == "output" for n in names)
    with pytest.raises(SmeltError, match=r"fake_quant.skip: 'attention.wz' matches no module"):
        swap_to_fake_quant(build_model(tiny_config(), seed=1), spec, skip=("output", "attention.wz"))
    with pytest.raises(SmeltError, match="must be a list of module names, not the string 'output'"):
        swap_to_fake_quant(build_model(tiny_config(), seed=1), spec, skip="output")
    tied = build_model(tiny_config(tie_embeddings=True), seed=1)
    with pytest.raises(SmeltError, match="must keep 'output': the head shares its weight with the embeddings"):
        swap_to_fake_quant(tied, spec, skip=())
    untied = build_model(tiny_config(tie_embeddings=False), seed=1)
    assert "output" in swap_to_fake_quant(untied, spec, skip=())  # an untied head may be quantized


def test_fake_quant_config_is_typed():
    cfg = FakeQuantConfig(enable=True, group_size=-1, learn_scale=True, skip=["output"])
    assert (cfg.spec.group_size, cfg.group_size, cfg.learn_scale, cfg.skip) == (None, None, True, ("output",))
    assert cfg.spec == QuantSpec(group_size=None)
    with pytest.raises(SmeltError, match="fake_quant.learn_scale='false' must be true or false"):
        FakeQuantConfig(learn_scale="false")
    with pytest.raises(SmeltError, match="fake_quant.skip='output' must be a list"):
        FakeQuantConfig(skip="output")
    with pytest.raises(SmeltError, match="fake_quant.bits: .*bits=3"):
        FakeQuantConfig(bits=3)
    with pytest.raises(SmeltError, match="fake_quant.group_size: group_size=0"):
        FakeQuantConfig(group_size=0)
    with pytest.raises(TypeError, match="group_sz"):
        FakeQuantConfig(group_sz=32)


def test_saved_scales_load_only_into_the_grid_they_were_fitted_for(tmp_path):
    from qat.qparams import load_qparams_into, save_qparams

    spec = QuantSpec(group_size=32)
    src = build_model(tiny_config(), seed=1)
    qparams = {n: rtn(src.get_submodule(n).weight, spec)[1:] for n in linear_names(src)}
    save_qparams(src, qparams, spec, tmp_path)

    same = build_model(tiny_config(), seed=1)
    swap_to_fake_quant(same, spec)
    assert load_qparams_into(same, tmp_path)
    assert torch.equal(same.get_submodule("layers.0.attention.wq").weight_scale, qparams["layers.0.attention.wq"][0])
    for other, field in ((QuantSpec(group_size=32, symmetric=False), "symmetric"),
                         (QuantSpec(group_size=32, bits=8), "bits"), (QuantSpec(group_size=64), "group_size")):
        model = build_model(tiny_config(), seed=1)
        swap_to_fake_quant(model, other)
        with pytest.raises(SmeltError, match=f"was fitted for {field}="):
            load_qparams_into(model, tmp_path)
    fewer = build_model(tiny_config(), seed=1)
    swap_to_fake_quant(fewer, spec, skip=("output", "layers.1"))
    with pytest.raises(SmeltError, match=r"quantized layers\.1\.\S+, which this run keeps in full precision"):
        load_qparams_into(fewer, tmp_path)
