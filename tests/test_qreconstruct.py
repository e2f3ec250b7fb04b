"""qat.reconstruct: a quantized MLP fitted on its grid (weights by STE, scales learned), the swap to fake
quantization and back, and the CLI on a tiny GPTQ artifact."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch import nn

from core.block_fit import ReconstructConfig, fit_nmse, reconstruct_mlp
from core.errors import SmeltError, run_cli
from core.masks import load_masks
from core.patterns import NMPattern
from models.hf_io import load_hf
from models.llama import FeedForward
from qat.qparams import QPARAMS_FILE, read_qparams
from qat.quantizers import QuantSpec, rtn
from qat.reconstruct import QuantReconstructConfig, from_fake_quant, main, to_fake_quant
from qat.release import integer_codes

SPEC = QuantSpec(bits=4, symmetric=True, group_size=16)


class _Holder(nn.Module):
    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.mlp = mlp


def _quantized_pair(seed: int = 0, d: int = 32, hidden: int = 64):
    """A dense MLP, its 2:4-pruned RTN W4 g16 copy (in a holder, so its linears have dotted names) with masks and
    qparams, and inputs / dense outputs (64 windows of 32)."""
    torch.manual_seed(seed)
    dense = FeedForward(d, hidden)
    holder = _Holder(FeedForward(d, hidden))
    holder.mlp.load_state_dict(dense.state_dict())
    masks, qparams = {}, {}
    with torch.no_grad():
        for k in ("w1", "w2", "w3"):
            w = getattr(holder.mlp, k).weight
            masks[k] = NMPattern(2, 4).keep_top(w.abs())
            w_q, scale, zp = rtn(w * masks[k], SPEC, name=k)
            w.copy_(w_q)
            qparams[f"mlp.{k}"] = (scale, zp)
        x = torch.randn(64 * 32, d)
        y = dense(x)
    return holder, masks, qparams, x, y


def test_swapping_to_fake_quant_and_back_keeps_an_untrained_model_exactly():
    holder, _, qparams, x, _ = _quantized_pair()
    before = {k: v.clone() for k, v in holder.state_dict().items()}
    out = holder.mlp(x)
    originals = to_fake_quant(holder, qparams, SPEC)
    assert type(holder.mlp.w1).__name__ == "FakeQuantLinear" and holder.mlp.w1.weight is originals["mlp.w1"].weight
    torch.testing.assert_close(holder.mlp(x), out, rtol=0, atol=1e-6)  # the grid reproduces RTN's weights
    back = from_fake_quant(holder, originals)
    assert type(holder.mlp.w1) is nn.Linear
    for k, v in holder.state_dict().items():
        assert torch.equal(v, before[k]), k
    for name, (scale, _) in back.items():
        assert torch.equal(scale, qparams[name][0])


def test_a_quantized_fit_learns_weights_and_scales_on_the_grid_and_keeps_the_masks():
    holder, masks, qparams, x, y = _quantized_pair()
    originals = to_fake_quant(holder, qparams, SPEC)
    start = fit_nmse(holder.mlp, x, y)
    cfg = QuantReconstructConfig(epochs=3, lr=1e-3, scale_lr=1e-3, batch_tokens=64, inputs="teacher")
    groups = cfg.param_groups({k: getattr(holder.mlp, k) for k in ("w1", "w2", "w3")})
    assert [g["lr"] for g in groups] == [1e-3, 1e-3] and all(p.dim() == 2 for g in groups for p in g["params"])
    r = reconstruct_mlp(holder.mlp, masks, x, y, cfg, 32)
    assert r["after"]["heldout"] < 0.95 * r["before"]["heldout"] and fit_nmse(holder.mlp, x, y) < start
    fq_err = fit_nmse(holder.mlp, x[:256], y[:256])
    fitted = from_fake_quant(holder, originals)
    # what was written is what was fitted: the plain linears give the fake-quantized forward's error
    assert fit_nmse(holder.mlp, x[:256], y[:256]) == pytest.approx(fq_err, rel=1e-5)
    for k in ("w1", "w2", "w3"):
        w, (scale, _) = getattr(holder.mlp, k).weight, fitted[f"mlp.{k}"]
        assert not torch.equal(scale, qparams[f"mlp.{k}"][0])  # the scales were learned
        q = integer_codes(k, w, scale, SPEC)  # on the grid of its own scales, or a SmeltError
        assert SPEC.qmin <= int(q.min()) and int(q.max()) <= SPEC.qmax and bool((w[~masks[k]] == 0).all())


def test_the_float_fit_trains_weights_only_and_bad_scale_lr_names_its_flag():
    holder, _, _, _, _ = _quantized_pair()
    groups = ReconstructConfig().param_groups({"w1": holder.mlp.w1})
    assert len(groups) == 1 and groups[0]["params"] == [holder.mlp.w1.weight]
    with pytest.raises(SmeltError, match=r"--scale-lr=0.0 must be > 0"):
        QuantReconstructConfig(scale_lr=0.0)
    assert QuantReconstructConfig().inputs == "block"


def _gptq_artifact(tiny_model_dir, tmp_path):
    from prune.run import main as prune_main
    from qat.ptq import main as ptq_main

    pruned, out = tmp_path / "pruned", tmp_path / "gptq"
    prune_main(["--teacher", str(tiny_model_dir), "--method", "sparsegpt", "--pattern", "2:4", "--out", str(pruned),
                "--calib-windows", "4", "--calib-seq-len", "64", "--skip", "output,tok_embeddings,attention.wo"])
    ptq_main(["--teacher", str(tiny_model_dir), "--artifact", str(pruned), "--method", "gptq", "--group-size", "16",
              "--calib-windows", "4", "--calib-seq-len", "64", "--out", str(out)])
    return out


def test_cli_fits_a_gptq_artifact_into_a_quantized_artifact_a_release_can_pack(tiny_model_dir, tmp_path):
    src = _gptq_artifact(tiny_model_dir, tmp_path)
    out = tmp_path / "fit"
    main(["--artifact", str(src), "--teacher", str(tiny_model_dir), "--out", str(out), "--calib-windows", "10",
          "--calib-seq-len", "64", "--epochs", "3", "--lr", "1e-3", "--scale-lr", "1e-3", "--batch-tokens", "64",
          "--blocks", "1"])
    m = json.loads((out / "manifest.json").read_text())
    assert m["stage"] == "qreconstruct" and m["parent"]["stage"] == "ptq" and m["settings"]["inputs"] == "block"
    r = m["metrics"]["per_block"]["1"]
    assert r["after"]["heldout"] <= r["before"]["heldout"]
    assert (out / "masks.safetensors").read_bytes() == (src / "masks.safetensors").read_bytes()
    (q0, spec0), (q1, spec1) = read_qparams(src), read_qparams(out)
    assert spec0 == spec1 and q0.keys() == q1.keys()
    before, after, masks = load_hf(src).state_dict(), load_hf(out).state_dict(), load_masks(out)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.startswith("layers.1.feed_forward.") for k in changed)  # only block 1's MLP moved
    for name, (scale, _) in q1.items():
        assert torch.equal(scale, q0[name][0]) == (not name.startswith("layers.1.feed_forward."))
        integer_codes(name, after[name + ".weight"], scale, spec1)  # on the grid, as the release needs
        if name in masks:
            assert bool((after[name + ".weight"][~masks[name]] == 0).all())


def test_cli_refuses_an_artifact_without_qparams_in_one_line_and_writes_nothing(tiny_model_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        run_cli(lambda: main(["--artifact", str(tiny_model_dir), "--out", str(tmp_path / "r")]))
    assert exc.value.code == 2
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and f"has no {QPARAMS_FILE} (not a quantized artifact)" in lines[0], lines
    assert not (tmp_path / "r").exists()


def test_a_qreconstruct_stage_fits_the_ptq_artifact_and_refuses_bad_settings(capfd, tmp_path, tiny_model_dir):
    """kind = "qreconstruct" after a ptq stage: qat.reconstruct on its artifact, into its own; it reads quantized
    artifacts only; bad settings are one-line errors before anything runs."""
    from test_recipe import _cli as _recipe_cli
    from test_recipe import _run as _recipe

    run = tmp_path / "run"
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'name = "r"\nteacher = "{tiny_model_dir}"\nrun_dir = "{run}"\n[data]\n'
                      'calibration = "wikitext2-valid"\n[[stages]]\nkind = "prune"\nmethod = "magnitude"\n'
                      'pattern = "2:4"\nevaluate = false\n[[stages]]\nkind = "ptq"\nmethod = "rtn"\ngroup_size = 16\n'
                      'evaluate = false\n[[stages]]\nkind = "qreconstruct"\nepochs = 1\nscale_lr = 1e-3\n'
                      'calib_windows = 2\ncalib_seq_len = 32\nevaluate = false\n')
    assert _recipe(recipe, "--stage", "prune") == 0, capfd.readouterr().err[-2000:]
    assert _recipe(recipe, "--stage", "ptq") == 0, capfd.readouterr().err[-2000:]
    code = _recipe(recipe, "--stage", "qreconstruct")
    out = capfd.readouterr()
    assert code == 0, out.err[-2000:]
    assert (f"qat.reconstruct --artifact {run}/ptq --teacher {tiny_model_dir} --scale-lr 0.001 --epochs 1 "
            f"--calib-windows 2 --calib-seq-len 32 --calib-corpus wikitext2-valid --calib-sampling disjoint --out {run}/qreconstruct") in out.out
    manifest = json.loads((run / "qreconstruct" / "manifest.json").read_text())
    assert manifest["stage"] == "qreconstruct" and manifest["parent"]["path"] == str(run / "ptq")
    assert len(manifest["metrics"]["per_block"]) == 2 and manifest["settings"]["scale_lr"] == 1e-3
    code, _, err = _recipe_cli(capfd, recipe, "--dry-run", "--set", "stages.qreconstruct.scale_lr=0")
    assert code == 2 and err.strip().endswith("stages[2].scale_lr=0.0 must be > 0"), err
    code, _, err = _recipe_cli(capfd, recipe, "--dry-run", "--set", "stages.qreconstruct.fit=block",
                               "--set", "stages.qreconstruct.inputs=student")
    assert code == 2 and "stages[2].fit='block' fits the block's output" in err.strip().splitlines()[-1], err
    code, _, err = _recipe_cli(capfd, recipe, "--dry-run", "--set", "stages.qreconstruct.input=prune")
    assert code == 2 and err.strip().endswith("stages[2].input 'prune' is a prune stage; a qreconstruct stage's "
                                              "input is ptq or qreconstruct or qat output"), err


def test_a_qreconstruct_stage_aims_at_its_target_model(capfd, tmp_path, tiny_model_dir):
    """target = an earlier float model stage: its block outputs replace the teacher's as what the fit aims at (the
    pruned model the ptq artifact came from is far closer to it than the teacher is); a quantized stage or a
    missing directory as target is a one-line error before anything runs."""
    from test_recipe import _cli as _recipe_cli
    from test_recipe import _run as _recipe

    run = tmp_path / "run"
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'name = "r"\nteacher = "{tiny_model_dir}"\nrun_dir = "{run}"\n[data]\n'
                      'calibration = "wikitext2-valid"\n[[stages]]\nkind = "prune"\nmethod = "magnitude"\n'
                      'pattern = "2:4"\nevaluate = false\n[[stages]]\nkind = "ptq"\nmethod = "rtn"\ngroup_size = 16\n'
                      'evaluate = false\n[[stages]]\nkind = "qreconstruct"\nepochs = 1\ncalib_windows = 2\n'
                      'calib_seq_len = 32\nevaluate = false\n')
    for stage in ("prune", "ptq"):
        assert _recipe(recipe, "--stage", stage) == 0, capfd.readouterr().err[-2000:]
    befores = {}
    for target in (None, "prune"):
        sets = ["--set", f"stages.qreconstruct.target={target}", "--set", f"stages.qreconstruct.out=fit-{target}"] \
            if target else []
        code = _recipe(recipe, "--stage", "qreconstruct", *sets)
        out = capfd.readouterr()
        assert code == 0, out.err[-2000:]
        aim = run / "prune" if target else tiny_model_dir
        assert f"qat.reconstruct --artifact {run}/ptq --teacher {aim} --epochs 1" in out.out
        manifest = json.loads((run / (f"fit-{target}" if target else "qreconstruct") / "manifest.json").read_text())
        assert manifest["settings"]["teacher"] == str(aim)
        befores[target] = [b["before"]["heldout"] for b in manifest["metrics"]["per_block"].values()]
    # block 0 sees the same input either way: only the target differs
    assert befores["prune"][0] < 0.5 * befores[None][0], befores
    code, _, err = _recipe_cli(capfd, recipe, "--dry-run", "--set", "stages.qreconstruct.target=ptq")
    assert code == 2 and err.strip().endswith("stages[2].target 'ptq' is a ptq stage; a qreconstruct stage's "
                                              "target is prune or reconstruct or recover or mtp output"), err
    code, _, err = _recipe_cli(capfd, recipe, "--dry-run", "--set", f"stages.qreconstruct.target={tmp_path}/nope")
    assert code == 2 and err.strip().endswith(f"stages[2].target '{tmp_path}/nope' is neither an earlier stage nor "
                                              "an existing artifact directory"), err
    code, _, err = _recipe_cli(capfd, recipe, "--dry-run", "--set", "stages.qreconstruct.target=")
    assert code == 2 and err.strip().endswith("stages[2].target is empty: name an earlier float model stage or a "
                                              "directory (unset: the teacher)"), err
    plan = tmp_path / "plan.json"  # a directory as target; the plan names it
    assert _recipe(recipe, "--dry-run", "--json", plan, "--set", f"stages.qreconstruct.target={tiny_model_dir}") == 0
    assert json.loads(plan.read_text())["stages"][2]["target"] == str(tiny_model_dir)
    # a target stage not run yet: refused before qat.reconstruct starts, nothing written
    shutil.rmtree(run / "prune")
    code = _recipe(recipe, "--stage", "qreconstruct", "--set", "stages.qreconstruct.target=prune",
                   "--set", "stages.qreconstruct.out=fit-again")
    err = capfd.readouterr().err
    assert code == 2 and err.strip().endswith(f"stage qreconstruct: input {run}/prune does not exist (run the stage "
                                              "that writes it first)"), err
    assert not (run / "fit-again").exists()
