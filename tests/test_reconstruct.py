"""core.block_fit and prune.reconstruct: whole-MLP and block fits on kept weights, the held-out guard, and the CLI on
a tiny pruned artifact."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_config
from test_recipe import _cli as _recipe_cli
from test_recipe import _run as _recipe

from core.block_fit import (
    ReconstructConfig,
    fit_blocks,
    fit_nmse,
    part_masks,
    reconstruct_block,
    reconstruct_mlp,
)
from core.errors import SmeltError, run_cli
from core.masks import load_masks
from core.patterns import NMPattern
from models.hf_io import load_hf
from models.llama import FeedForward, TransformerBlock, build_model
from prune.reconstruct import main


def _pair(seed: int = 0, d: int = 32, hidden: int = 64):
    """A dense MLP, its 2:4 magnitude-pruned copy with the masks, and inputs / dense outputs (64 windows of 32)."""
    torch.manual_seed(seed)
    dense = FeedForward(d, hidden)
    pruned = FeedForward(d, hidden)
    pruned.load_state_dict(dense.state_dict())
    masks = {}
    with torch.no_grad():
        for k in ("w1", "w2", "w3"):
            w = getattr(pruned, k).weight
            masks[k] = NMPattern(2, 4).keep_top(w.abs())
            w.mul_(masks[k])
        x = torch.randn(64 * 32, d)
        y = dense(x)
    return dense, pruned, masks, x, y


def test_the_fit_lowers_held_out_error_and_never_revives_a_pruned_weight():
    _, pruned, masks, x, y = _pair()
    start = fit_nmse(pruned, x, y)
    r = reconstruct_mlp(pruned, masks, x, y, ReconstructConfig(epochs=3, lr=3e-3, batch_tokens=64), 32)
    assert r["before"]["heldout"] > 0.3  # 2:4 of every matrix of a random MLP: far from the dense outputs
    assert r["after"]["heldout"] < 0.95 * r["before"]["heldout"] and r["epoch_kept"] >= 1
    assert r["after"]["train"] < r["before"]["train"] and fit_nmse(pruned, x, y) < start
    assert r["steps"] == 3 * 29  # 58 training windows of 32 tokens (6 held out), two windows a step
    for k, m in masks.items():
        w = getattr(pruned, k).weight
        assert bool((w[~m] == 0).all()) and NMPattern(2, 4).holds(w)


def test_a_fit_that_only_gets_worse_keeps_the_starting_weights():
    _, pruned, masks, x, y = _pair(1)
    start = {k: v.clone() for k, v in pruned.state_dict().items()}
    r = reconstruct_mlp(pruned, masks, x, y, ReconstructConfig(epochs=2, lr=5.0, batch_tokens=32), 32)
    assert r["epoch_kept"] == 0 and r["after"]["heldout"] == r["before"]["heldout"]
    assert all(torch.equal(v, start[k]) for k, v in pruned.state_dict().items())


def test_held_out_rows_are_whole_windows_and_bad_settings_name_their_flag():
    _, pruned, masks, x, y = _pair()
    with pytest.raises(SmeltError, match="2048 rows are not whole windows of 48 tokens"):
        reconstruct_mlp(pruned, masks, x, y, ReconstructConfig(), 48)
    for kw, flag in (({"epochs": 0}, "--epochs=0"), ({"lr": 0.0}, "--lr=0.0"), ({"holdout": 1.0}, "--holdout=1.0"),
                     ({"batch_tokens": 1.5}, "--batch-tokens=1.5")):
        with pytest.raises(SmeltError, match=flag):
            ReconstructConfig(**kw)
    with pytest.raises(SmeltError, match="--fit='attention' must be one of mlp, block"):
        ReconstructConfig(fit="attention")
    with pytest.raises(SmeltError, match="--fit='block' fits the block's output: --inputs must be teacher or block"):
        ReconstructConfig(fit="block", inputs="student")


def test_a_block_fit_trains_attention_and_mlp_on_the_kept_weights_against_what_the_block_adds():
    cfg = tiny_config()
    torch.manual_seed(0)
    dense, pruned = TransformerBlock(cfg), TransformerBlock(cfg)
    pruned.load_state_dict(dense.state_dict())
    masks = {}
    with torch.no_grad():
        for name in ("attention.wq", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"):  # wk, wv, wo dense
            w = pruned.get_submodule(name).weight
            masks[name] = NMPattern(2, 4).keep_top(w.abs())
            w.mul_(masks[name])
        x = 3 * torch.randn(20, 16, cfg.dim) + 50 * torch.randn(cfg.dim)  # a stream far larger than the block's update
        model = build_model(cfg)
        cos, sin = model.rope_cos[:16], model.rope_sin[:16]
        y = dense(x, cos, sin)
    start = {k: v.clone() for k, v in pruned.state_dict().items()}

    def f(h):
        return pruned(h, cos, sin)
    # measured against what the block adds, not against its output (which the stream dominates)
    assert fit_nmse(f, x, y, residual=True) > 100 * fit_nmse(f, x, y)
    r = reconstruct_block(pruned, masks, x, y, cos, sin, ReconstructConfig(epochs=3, lr=3e-3, batch_tokens=32))
    assert r["steps"] == 3 * 9  # 18 training windows (2 held out), two windows of 16 tokens a step
    assert r["epoch_kept"] >= 1 and r["after"]["heldout"] < 0.9 * r["before"]["heldout"]
    after = pruned.state_dict()
    moved = {k for k in after if not torch.equal(after[k], start[k])}
    assert {"attention.wk.weight", "attention.wo.weight", "feed_forward.w2.weight"} <= moved  # dense ones too
    assert not any("norm" in k for k in moved)
    for name, m in masks.items():
        assert bool((after[name + ".weight"][~m] == 0).all())
    with pytest.raises(SmeltError, match="mask nope names no linear of the fitted part"):
        reconstruct_block(pruned, {"nope": masks["attention.wq"]}, x, y, cos, sin, ReconstructConfig())
    with pytest.raises(SmeltError, match="a block fit needs at least 2 windows"):
        reconstruct_block(pruned, masks, x[:1], y[:1], cos, sin, ReconstructConfig())


def test_part_masks_name_the_linears_inside_the_fitted_part():
    m = torch.ones(2, 4, dtype=torch.bool)
    masks = {"layers.1.attention.wq": m, "layers.1.feed_forward.w1": m, "layers.10.feed_forward.w1": m}
    assert list(part_masks(masks, "1", "mlp")) == ["w1"]
    assert list(part_masks(masks, "1", "block")) == ["attention.wq", "feed_forward.w1"]


def _block_io(model, tokens):
    """{block: (MLP input, MLP output, block output)} of a plain forward, rows flattened."""
    got, hooks = {}, []
    for key, layer in model.layers.items():
        def mlp_hook(_m, args, out, key=key):
            got[key] = [args[0].reshape(-1, args[0].shape[-1]), out.reshape(-1, out.shape[-1])]
        hooks.append(layer.feed_forward.register_forward_hook(mlp_hook))
        hooks.append(layer.register_forward_hook(lambda _m, _a, out, key=key: got[key].append(out.reshape(-1, out.shape[-1]))))
    with torch.no_grad():
        model.hidden_states(tokens)
    for h in hooks:
        h.remove()
    return got


def _stand_in_fit(teacher, student):
    """A stand-in for a fit that records each block's (x, y): block 0's MLP becomes zero, which block 1's inputs must
    show; reset() empties the record and gives block 0's MLP its perturbed start (half the teacher's down projection)."""
    seen = {}

    def fit(b, x, y):
        seen[b] = (x, y)
        if b == "0":
            student.layers["0"].feed_forward.w2.weight.data.zero_()

    def reset():
        seen.clear()
        student.layers["0"].feed_forward.w2.weight.data.copy_(teacher.layers["0"].feed_forward.w2.weight * 0.5)
    fit.reset = reset
    return seen, fit


def test_teacher_inputs_pair_each_blocks_mlp_input_with_its_output():
    model = build_model(tiny_config(), seed=1).eval()
    tokens = torch.randint(3, 200, (3, 16))
    ref, seen = _block_io(model, tokens), {}
    fit_blocks(model, model, tokens, 2, ["0", "1"], "teacher", lambda b, x, y: seen.__setitem__(b, (x, y)))
    assert list(seen) == ["0", "1"]
    for b, (x, y) in seen.items():
        assert x.shape == (48, model.cfg.dim) == y.shape
        assert torch.allclose(x, ref[b][0], atol=1e-5) and torch.allclose(y, ref[b][1], atol=1e-5)


def test_student_inputs_run_through_the_blocks_as_fitted_and_block_targets_complete_the_teachers_output():
    teacher = build_model(tiny_config(), seed=1).eval()
    student = build_model(tiny_config(), seed=1).eval()
    with torch.no_grad():  # the student differs from block 0 on: its attention and MLP perturbed
        for name, p in student.layers["0"].named_parameters():
            if p.dim() == 2:
                p.mul_(0.5)
    tokens = torch.randint(3, 200, (3, 16))
    ref_t = _block_io(teacher, tokens)

    seen, fit = _stand_in_fit(teacher, student)
    for inputs in ("student", "block"):
        fit.reset()
        fit_blocks(teacher, student, tokens, 2, ["0", "1"], inputs, fit)
        ref_s = _block_io(student, tokens)  # the student as fitted (block 0's MLP zero)
        for b in ("0", "1"):
            x, y = seen[b]
            assert torch.allclose(x, ref_s[b][0], atol=1e-5)  # its own MLP inputs, after block 0 as fitted
            if inputs == "student":
                assert torch.allclose(y, ref_t[b][1], atol=1e-5)  # the teacher's MLP outputs
            else:  # the residual after the student's attention plus y is the teacher's block output
                mid = ref_s[b][2] - ref_s[b][1]
                assert torch.allclose(mid + y, ref_t[b][2], atol=1e-4)
        assert not torch.allclose(seen["1"][0], ref_t["1"][0], atol=1e-3)  # not the teacher's inputs
    with pytest.raises(SmeltError, match="--inputs='x' must be one of teacher, student, block"):
        fit_blocks(teacher, student, tokens, 2, ["0"], "x", fit)


def test_block_fits_get_the_block_inputs_and_the_teachers_block_outputs():
    teacher = build_model(tiny_config(), seed=1).eval()
    student = build_model(tiny_config(), seed=1).eval()
    tokens = torch.randint(3, 200, (3, 16))
    ref_t, d = _block_io(teacher, tokens), teacher.cfg.dim

    seen, fit = _stand_in_fit(teacher, student)
    for inputs in ("teacher", "block"):
        fit.reset()
        fit_blocks(teacher, student, tokens, 2, ["0", "1"], inputs, fit, part="block")
        ref_s = _block_io(student, tokens)  # the student as fitted
        for b in ("0", "1"):
            x, y = seen[b]
            assert x.shape == (3, 16, d) == y.shape
            assert torch.allclose(y.reshape(-1, d), ref_t[b][2], atol=1e-5)  # the teacher's block outputs
        assert torch.allclose(seen["0"][0], teacher.tok_embeddings(tokens), atol=1e-6)
        # block 1's inputs: the student's block 0 output as fitted, or the teacher's
        own = (ref_s if inputs == "block" else ref_t)["0"][2]
        assert torch.allclose(seen["1"][0].reshape(-1, d), own, atol=1e-5)
        assert not torch.allclose(ref_s["0"][2], ref_t["0"][2], atol=1e-3)
    with pytest.raises(SmeltError, match="--fit='block' fits the block's output"):
        fit_blocks(teacher, student, tokens, 2, ["0"], "student", fit, part="block")


def _pruned_artifact(tiny_model_dir, tmp_path):
    from prune.run import main as prune_main

    out = tmp_path / "pruned"
    prune_main(["--teacher", str(tiny_model_dir), "--method", "sparsegpt", "--pattern", "2:4", "--out", str(out),
                "--calib-windows", "4", "--calib-seq-len", "64", "--skip", "output,tok_embeddings,attention.wo"])
    return out


@pytest.mark.parametrize("fit", ["mlp", "block"])
def test_cli_writes_an_artifact_with_the_sources_masks_and_lower_error(tiny_model_dir, tmp_path, fit):
    src = _pruned_artifact(tiny_model_dir, tmp_path)
    out = tmp_path / "recon"
    main(["--artifact", str(src), "--teacher", str(tiny_model_dir), "--out", str(out), "--calib-windows", "10",
          "--calib-seq-len", "64", "--epochs", "3", "--lr", "1e-3", "--batch-tokens", "64", "--blocks", "1",
          "--fit", fit, "--inputs", "block"])
    m = json.loads((out / "manifest.json").read_text())
    assert m["stage"] == "reconstruct" and m["settings"]["blocks"] == ["1"] and m["parent"]["stage"] == "prune"
    r = m["metrics"]["per_block"]["1"]
    assert r["after"]["heldout"] <= r["before"]["heldout"]
    assert (out / "masks.safetensors").read_bytes() == (src / "masks.safetensors").read_bytes()
    before, after, masks = load_hf(src).state_dict(), load_hf(out).state_dict(), load_masks(out)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.startswith("layers.1.feed_forward.") for k in changed) == (fit == "mlp")
    assert all(k.startswith("layers.1.") for k in changed)  # only block 1's MLP, or its linears, moved
    assert ("layers.1.attention.wo.weight" in changed) == (fit == "block")
    for name, keep in masks.items():
        assert bool((after[name + ".weight"][~keep] == 0).all())


@pytest.mark.parametrize("args,message", [
    (["--blocks", "7"], "--blocks: 7 is not a block of"),
    (["--blocks", "a"], "--blocks 'a' is not a comma-separated list"),
    (["--holdout", "0"], "--holdout=0.0 must be in (0, 1)"),
    (["--inputs", "dense"], "--inputs='dense' must be one of teacher, student, block"),
    (["--fit", "block", "--inputs", "student"], "--fit='block' fits the block's output"),
])
def test_cli_bad_input_is_one_line_and_writes_nothing(tiny_model_dir, tmp_path, capsys, args, message):
    src = _pruned_artifact(tiny_model_dir, tmp_path)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        run_cli(lambda: main(["--artifact", str(src), "--teacher", str(tiny_model_dir), "--out",
                              str(tmp_path / "recon"), "--calib-windows", "2", "--calib-seq-len", "32", *args]))
    assert exc.value.code == 2
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pruned", "teacher"]


def test_cli_refuses_an_artifact_without_masks(tiny_model_dir, tmp_path, capsys):
    with pytest.raises(SystemExit):
        run_cli(lambda: main(["--artifact", str(tiny_model_dir), "--out", str(tmp_path / "r")]))
    assert "has no masks.safetensors (not a pruned artifact)" in capsys.readouterr().err


def test_a_reconstruct_stage_refits_the_pruned_mlps_and_refuses_bad_settings(capfd, tmp_path, tiny_model_dir):
    """kind = "reconstruct" after a prune stage: prune.reconstruct on its artifact, into its own; bad settings are
    one-line errors before anything runs."""
    run = tmp_path / "run"
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'name = "r"\nteacher = "{tiny_model_dir}"\nrun_dir = "{run}"\n[data]\n'
                      'calibration = "wikitext2-valid"\n[[stages]]\nkind = "prune"\nmethod = "magnitude"\n'
                      'pattern = "2:4"\nevaluate = false\n[[stages]]\nkind = "reconstruct"\nepochs = 1\ninputs = "block"\n'
                      'calib_windows = 2\ncalib_seq_len = 32\nevaluate = false\n')
    assert _recipe(recipe, "--stage", "prune") == 0, capfd.readouterr().err[-2000:]
    code = _recipe(recipe, "--stage", "reconstruct")
    out = capfd.readouterr()
    assert code == 0, out.err[-2000:]
    assert (f"prune.reconstruct --artifact {run}/prune --teacher {tiny_model_dir} --epochs 1 --inputs block --calib-windows 2 "
            f"--calib-seq-len 32 --calib-corpus wikitext2-valid --calib-sampling disjoint --out {run}/reconstruct") in out.out
    manifest = json.loads((run / "reconstruct" / "manifest.json").read_text())
    assert manifest["stage"] == "reconstruct" and manifest["parent"]["path"] == str(run / "prune")
    assert len(manifest["metrics"]["per_block"]) == 2  # the debug flavor's two blocks
    code, _, err = _recipe_cli(capfd, recipe, "--dry-run", "--set", "stages.reconstruct.epochs=0")
    assert code == 2 and err.strip().endswith("stages[1]: lr > 0 and epochs >= 1 are required (got None, 0)"), err
    code, _, err = _recipe_cli(capfd, recipe, "--dry-run", "--set", "stages.reconstruct.inputs=dense")
    assert code == 2 and err.strip().endswith("stages[1].inputs='dense' must be one of teacher, student, block"), err
    code, _, err = _recipe_cli(capfd, recipe, "--dry-run", "--set", "stages.reconstruct.fit=block",
                               "--set", "stages.reconstruct.inputs=student")
    assert code == 2 and "stages[1].fit='block' fits the block's output: stages[1].inputs must be teacher or block" \
        in err.strip().splitlines()[-1], err
