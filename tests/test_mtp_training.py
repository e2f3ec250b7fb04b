"""MTP modules through the real trainer (2 gloo ranks, FSDP2): trained on the frozen distilled student, to
the teacher or to the main model itself (mtp.target main), or jointly; the exported file, its fingerprint,
exact drafting, and the file travelling through PTQ."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import ROOT, check_offline_export, launch_log, make_byte_tokenizer, make_distill_dirs
from test_trainer import LAUNCH, _env, distill_straight

from core.masks import load_masks
from models.hf_io import load_hf, save_hf
from train.masks import MaskSet


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return make_distill_dirs(tmp_path_factory.mktemp("mtp"))


@pytest.fixture(scope="module")
def straight_run(dirs):
    return distill_straight(dirs)


def _windows() -> torch.Tensor:
    from core.data import calibration_windows

    return calibration_windows(make_byte_tokenizer(), 4, 32, seed=7)


def _mtp_kl(model, heads, teacher, tokens) -> float:
    """Mean KL(teacher's distribution of t_{i+2} || MTP module 1's) over `tokens`."""
    from core.kl import kl_rows

    with torch.no_grad():
        logits = heads(model, heads.level0(model, tokens)[1], tokens)[0][:, :-1]
        t = teacher(tokens)[:, 1:-1]
        return float(kl_rows(t.log_softmax(-1), logits.log_softmax(-1)).mean())


def test_mtp_trains_on_the_frozen_model_exports_its_file_and_drafts_exactly(dirs, straight_run):
    from core.errors import SmeltError
    from models.generate import sample
    from models.mtp import MTPHeads, load_mtp, mtp_metadata
    from models.speculative import speculative_generate

    src, out = straight_run.out, dirs / "mtp-out"
    cmd = LAUNCH[:-1] + ["debug_mtp", "--student", str(src), "--teacher", str(dirs / "teacher"), "--dump_folder",
                         str(dirs / "mtp"), "--export_dir", str(out), "--training.steps", "12"]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, launch_log(proc)
    check_offline_export(dirs / "mtp" / "checkpoint" / "step-12", out, dirs / "mtp-offline")
    main, trained = load_hf(src), load_hf(out)
    assert all(torch.equal(a, b) for a, b in zip(main.state_dict().values(), trained.state_dict().values()))
    assert set(load_masks(out)) == set(load_masks(src))  # the frozen main model's masks travel on
    meta = mtp_metadata(out)
    assert meta["depth"] == "2" and json.loads((out / "manifest.json").read_text())["stage"] == "mtp"
    heads = load_mtp(out, trained)
    start = MTPHeads(main.cfg, 2)
    start.init_weights(seed=0, trunk=main)  # where training started (config seed 0, init last_block)
    teacher = load_hf(dirs / "teacher")
    tokens = _windows()
    assert _mtp_kl(trained, heads, teacher, tokens) < 0.9 * _mtp_kl(main, start, teacher, tokens)
    prompt = tokens[:1, :8]
    for gamma in (1, 2):
        got, stats = speculative_generate(trained, heads, prompt, 24, gamma=gamma)
        assert torch.equal(got, sample(trained, prompt, 24, temperature=0)) and stats.rounds < 24
    with pytest.raises(SmeltError, match="MTP depth 3 requested, the file holds 2"):
        load_mtp(out, trained, depth=3)
    with pytest.raises(SmeltError, match="trained against another main model"):
        load_mtp(_copy_with_other_weights(out, dirs / "mtp-moved"), trained)
    # the MTP file travels through PTQ unchanged, still naming the model it was trained against
    from qat.ptq import main as ptq

    ptq(["--teacher", str(dirs / "teacher"), "--artifact", str(out), "--method", "rtn", "--group-size", "32",
         "--out", str(dirs / "mtp-rtn")])
    assert (dirs / "mtp-rtn" / "mtp.safetensors").read_bytes() == (out / "mtp.safetensors").read_bytes()
    with pytest.raises(SmeltError, match="trained against another main model"):
        load_mtp(dirs / "mtp-rtn", load_hf(dirs / "mtp-rtn"))
    assert load_mtp(dirs / "mtp-rtn", load_hf(dirs / "mtp-rtn"), check_fingerprint=False).depth == 2


def test_mtp_target_main_distils_to_the_frozen_main_model_without_running_a_teacher(dirs, straight_run):
    from models.mtp import MTPHeads, load_mtp

    src, out = straight_run.out, dirs / "mtp-main-out"
    cmd = LAUNCH[:-1] + ["debug_mtp_main", "--student", str(src), "--teacher", str(dirs / "teacher"),
                         "--dump_folder", str(dirs / "mtp-main"), "--export_dir", str(out), "--training.steps", "12"]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, launch_log(proc)
    assert "teacher the frozen main model itself (mtp.target main)" in proc.stdout + proc.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["stage"] == "mtp" and manifest["settings"]["mtp"]["target"] == "main"
    main, trained = load_hf(src), load_hf(out)
    heads = load_mtp(out, trained)
    start = MTPHeads(main.cfg, 2)
    start.init_weights(seed=0, trunk=main)
    tokens = _windows()
    # The target was the main model's own distribution one token on: the module moved towards it.
    assert _mtp_kl(trained, heads, main, tokens) < 0.9 * _mtp_kl(main, start, main, tokens)


def _feature_nmse(model, heads, tokens) -> float:
    """Mean normalised MSE between module 1's head input at i and the main model's at i + 1."""
    with torch.no_grad():
        h0 = model.hidden_states(tokens)
        f = heads(model, h0, tokens, features=True)[1][0]
        return float(((f - h0[:, 1:]).pow(2).sum(-1) / h0[:, 1:].pow(2).sum(-1)).mean())


def test_mtp_feature_regression_pulls_the_module_features_onto_the_main_models(dirs, straight_run):
    """mtp.feature_weight: the per-token feature nMSE is logged per module, and training lowers it (and the
    KL to the main model) from the start's."""
    from models.mtp import MTPHeads, load_mtp

    src, out = straight_run.out, dirs / "mtp-feat-out"
    cmd = LAUNCH[:-1] + ["debug_mtp_features", "--student", str(src), "--teacher", str(dirs / "teacher"),
                         "--dump_folder", str(dirs / "mtp-feat"), "--export_dir", str(out), "--training.steps", "12"]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, launch_log(proc)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["settings"]["mtp"]["feature_weight"] == 1.0
    main = load_hf(src)
    heads = load_mtp(out, load_hf(out))
    start = MTPHeads(main.cfg, 2)
    start.init_weights(seed=0, trunk=main)
    tokens = _windows()
    assert _feature_nmse(main, heads, tokens) < 0.8 * _feature_nmse(main, start, tokens)
    assert _mtp_kl(main, heads, main, tokens) < 0.9 * _mtp_kl(main, start, main, tokens)


def test_a_fused_module_trains_reading_an_earlier_block_and_drafts_exactly(dirs, straight_run):
    """mtp.fuse_layers through the trainer: the file records the block, the module learns to read it (its
    columns leave zero), moves towards the main model's distribution, and drafts exactly."""
    from models.generate import sample
    from models.mtp import MTPHeads, load_mtp, mtp_metadata
    from models.speculative import speculative_generate

    src, out = straight_run.out, dirs / "mtp-fused-out"
    cmd = LAUNCH[:-1] + ["debug_mtp_fused", "--student", str(src), "--teacher", str(dirs / "teacher"),
                         "--dump_folder", str(dirs / "mtp-fused"), "--export_dir", str(out), "--training.steps", "12"]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, launch_log(proc)
    assert json.loads((out / "manifest.json").read_text())["settings"]["mtp"]["fuse_layers"] == [0]
    assert mtp_metadata(out)["fuse_layers"] == "0"
    main = load_hf(out)
    heads = load_mtp(out, main)
    assert heads.fuse_layers == (0,) and heads.mtp[0].proj.weight[:, 2 * main.cfg.dim:].abs().max() > 1e-4
    start = MTPHeads(main.cfg, 2, (0,))
    start.init_weights(seed=0, trunk=main)
    tokens = _windows()
    assert _mtp_kl(main, heads, main, tokens) < 0.9 * _mtp_kl(main, start, main, tokens)
    prompt = tokens[:1, :8]
    got, stats = speculative_generate(main, heads, prompt, 24, gamma=2)
    assert torch.equal(got, sample(main, prompt, 24, temperature=0)) and stats.rounds > 0


def test_mtp_joint_mode_trains_the_main_model_too(dirs, straight_run):
    from models.mtp import load_mtp

    src, out = straight_run.out, dirs / "mtp-joint-out"
    cmd = LAUNCH[:-1] + ["debug_mtp_joint", "--student", str(src), "--teacher", str(dirs / "teacher"),
                         "--dump_folder", str(dirs / "mtp-joint"), "--export_dir", str(out)]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, launch_log(proc)
    start, trained = load_hf(src), load_hf(out)
    w0, w1 = start.layers["0"].feed_forward.w3.weight, trained.layers["0"].feed_forward.w3.weight
    assert not torch.equal(w0, w1)  # the main model trained
    assert MaskSet(trained, load_masks(out)).violations() == 0  # and kept its masks
    assert load_mtp(out, trained).depth == 1  # the modules name the main model they were trained with


def _copy_with_other_weights(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    model = load_hf(dst)
    with torch.no_grad():
        model.norm.weight.add_(0.01)
    save_hf(model, dst)
    return dst
