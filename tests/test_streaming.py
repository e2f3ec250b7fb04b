"""Calibration that streams the model (prune.run --max-memory): blocks read from the checkpoint one at a
time, the artifact written block by block, and the result identical to the in-memory run's."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_config
from safetensors import safe_open
from safetensors.torch import load_file

from core.errors import SmeltError, run_cli
from core.safetensors_stream import StreamedSafetensors
from models.llama import FLAVORS
from models.streamed import StreamedModel, footprint
from prune.run import main

CALIB = ["--calib-windows", "4", "--calib-seq-len", "64", "--calib-batch-size", "2"]


def test_streamed_file_is_a_safetensors_file_with_every_dtype_and_row_chunks(tmp_path):
    tensors = {"a": torch.randn(5, 3), "b": torch.randn(4).to(torch.bfloat16), "c": torch.rand(2, 7) > 0.5,
               "d": torch.arange(6, dtype=torch.int32)}
    w = StreamedSafetensors(tmp_path / "x.safetensors", [(k, v.dtype, v.shape) for k, v in tensors.items()],
                            {"format": "pt"})
    w.write("a", tensors["a"][:2], part=True)  # a tensor in row chunks
    w.write("a", tensors["a"][2:], part=True)
    for k in "bcd":
        w.write(k, tensors[k])
    w.close()
    back = load_file(tmp_path / "x.safetensors")
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], v) for k, v in tensors.items())
    with safe_open(tmp_path / "x.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
    assert [p.name for p in tmp_path.iterdir()] == ["x.safetensors"]  # no temporary left


def test_streamed_file_refuses_disorder_wrong_shapes_and_an_early_close(tmp_path):
    layout = [("a", torch.float32, (2, 2)), ("b", torch.float32, (3,))]
    w = StreamedSafetensors(tmp_path / "x.safetensors", layout)
    with pytest.raises(SmeltError, match="b written out of order"):
        w.write("b", torch.zeros(3))
    with pytest.raises(SmeltError, match=r"a is torch.float32 \(3, 2\), the layout says"):
        w.write("a", torch.zeros(3, 2))
    with pytest.raises(SmeltError, match=r"a got more rows than its shape \(2, 2\)"):
        w.write("a", torch.zeros(3, 2), part=True)
    w.write("a", torch.zeros(2, 2))  # the failed writes changed nothing
    with pytest.raises(SmeltError, match="closed before b was written"):
        w.close()
    assert list(tmp_path.iterdir()) == []  # nothing that looks like a file, no temporary


@pytest.mark.parametrize("method", [["--method", "sparsegpt", "--pattern", "2:4"],
                                    ["--method", "wanda", "--sparsity", "0.5"],
                                    ["--method", "magnitude", "--pattern", "2:4"],
                                    ["--method", "sparsegpt", "--pattern", "2:4", "--refit", "teacher"],
                                    ["--method", "wanda", "--pattern", "2:4", "--refit", "layer"],
                                    ["--method", "sparsegpt", "--pattern", "2:4", "--calib-true-sequential"]],
                         ids=["sparsegpt", "wanda", "mag", "sparsegpt-refit-teacher", "wanda-refit", "sparsegpt-ts"])
def test_streamed_artifact_equals_the_in_memory_one(tiny_model_dir, tmp_path, method):
    heads = tmp_path / "heads.json"  # protected rows travel through the streamed masks file too
    heads.write_text(json.dumps({"protected": [{"layer": "1", "head": 3, "why": ["sink"]}]}))
    common = ["--teacher", str(tiny_model_dir), *method, *CALIB, "--protect", str(heads)]
    run_cli(lambda: main([*common, "--out", str(tmp_path / "mem")]))
    run_cli(lambda: main([*common, "--out", str(tmp_path / "stream"), "--max-memory", "0.05"]))
    for name in ("model.safetensors", "masks.safetensors"):
        a, b = load_file(tmp_path / "mem" / name), load_file(tmp_path / "stream" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    assert (tmp_path / "mem" / "config.json").read_text() == (tmp_path / "stream" / "config.json").read_text()
    mem, streamed = (json.loads((tmp_path / d / "manifest.json").read_text()) for d in ("mem", "stream"))
    assert streamed["metrics"]["per_module"] == mem["metrics"]["per_module"]
    assert streamed["metrics"]["pruned_params"] == mem["metrics"]["pruned_params"] > 0
    assert mem["settings"]["stream"] is None
    assert streamed["settings"]["stream"]["max_memory_gib"] == 0.05
    assert 0 < streamed["settings"]["stream"]["footprint_gib"]["total"] <= 0.05


def test_a_limit_below_the_footprint_is_one_line_and_writes_nothing(tiny_model_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        run_cli(lambda: main(["--teacher", str(tiny_model_dir), "--method", "sparsegpt", "--pattern", "2:4", *CALIB,
                              "--out", str(tmp_path / "out"), "--max-memory", "0.0001"]))
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and err.count("\n") == 0, err
    assert "--max-memory 0.0001 GiB is less than the streamed calibration needs" in err and "activations" in err
    assert not (tmp_path / "out").exists()


def test_an_error_mid_stream_leaves_nothing(tiny_model_dir, tmp_path, capsys):
    # a singular Hessian (one 8-token window, no dampening) fails in the first block, after the output opened
    with pytest.raises(SystemExit) as exc:
        run_cli(lambda: main(["--teacher", str(tiny_model_dir), "--method", "sparsegpt", "--sparsity", "0.5",
                              "--percdamp", "0", "--calib-windows", "1", "--calib-seq-len", "8",
                              "--out", str(tmp_path / "out"), "--max-memory", "1"]))
    assert exc.value.code == 2 and "Hessian is singular" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["teacher"]


def test_streamed_model_holds_only_what_it_loaded(tiny_model_dir):
    s = StreamedModel(tiny_model_dir)
    assert all(p.is_meta for p in s.model.parameters())
    block = s.model.layers["0"]
    s.load("layers.0", block)
    assert not any(p.is_meta for p in block.parameters()) and all(p.is_meta for p in s.model.layers["1"].parameters())
    s.release("layers.0", block)
    assert all(p.is_meta for p in block.parameters())


def test_footprint_is_linear_in_windows_and_names_its_parts():
    cfg = FLAVORS["smollm2-135m"]
    a, b = (footprint(cfg, n, 512, 8, 4, hessian=True) for n in (64, 128))
    assert b["activations"] == 2 * a["activations"] and b["block_weights"] == a["block_weights"]
    assert b["block_phase"] - a["block_phase"] == a["activations"]
    assert footprint(cfg, 64, 512, 8, 4, hessian=False)["statistics"] < a["statistics"]
    # true-sequential: every batch parked at once, 5 d floats per token at wo for SmolLM2 (5 d > 2 d + f)
    ts = footprint(cfg, 64, 512, 8, 4, hessian=True, true_sequential=True)
    assert ts["batch_temporaries"] - a["batch_temporaries"] == 64 * 512 * 5 * cfg.dim * 4
    # bf16 forwards: the residual stream stays fp32, the linear inputs are bf16; the peak is then at w2
    # (h in fp32, its norm and the down input in bf16: 6528 bytes per token against 5760 at wo)
    bf = footprint(cfg, 64, 512, 8, 2, hessian=True, true_sequential=True)
    assert bf["activations"] == a["activations"]
    assert bf["batch_temporaries"] - a["batch_temporaries"] == 64 * 512 * (4 * cfg.dim + 2 * (cfg.dim + cfg.ffn_hidden))


@pytest.mark.parametrize("method", [["gptq"], ["rtn"], ["gptq", "--calib-true-sequential"]],
                         ids=["gptq", "rtn", "gptq-ts"])
def test_streamed_ptq_equals_the_in_memory_one_and_keeps_the_masks(tiny_model_dir, tmp_path, method):
    from qat.ptq import main as ptq

    pruned = tmp_path / "pruned"
    run_cli(lambda: main(["--teacher", str(tiny_model_dir), "--method", "magnitude", "--pattern", "2:4",
                          "--out", str(pruned)]))
    common = ["--teacher", str(tiny_model_dir), "--artifact", str(pruned), "--method", *method,
              "--group-size", "32", "--calib-windows", "4", "--calib-seq-len", "64"]
    run_cli(lambda: ptq([*common, "--out", str(tmp_path / "mem")]))
    run_cli(lambda: ptq([*common, "--out", str(tmp_path / "stream"), "--max-memory", "0.05"]))
    for name in ("model.safetensors", "qparams.safetensors", "masks.safetensors"):
        a, b = load_file(tmp_path / "mem" / name), load_file(tmp_path / "stream" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    with safe_open(tmp_path / "stream" / "qparams.safetensors", "pt") as f, \
            safe_open(tmp_path / "mem" / "qparams.safetensors", "pt") as g:
        assert f.metadata() == g.metadata()
    streamed = json.loads((tmp_path / "stream" / "manifest.json").read_text())
    assert streamed["settings"]["stream"]["max_memory_gib"] == 0.05


def test_streamed_ptq_refuses_a_quantized_head(tmp_path, byte_tokenizer, capsys):
    from models.hf_io import save_hf
    from models.llama import build_model
    from qat.ptq import main as ptq

    untied = tmp_path / "untied"  # a head of its own: quantizable, but not a block
    untied.mkdir()
    save_hf(build_model(tiny_config(tie_embeddings=False), seed=1), untied, tokenizer=byte_tokenizer)
    with pytest.raises(SystemExit) as exc:
        run_cli(lambda: ptq(["--teacher", str(untied), "--method", "rtn", "--group-size", "32",
                             "--skip", "tok_embeddings", "--out", str(tmp_path / "out"), "--max-memory", "1"]))
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and "output is outside them (add it to --skip)" in err, err
    assert not (tmp_path / "out").exists()
