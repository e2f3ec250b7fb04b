"""Bad input a user may hand any stage: one line naming the problem, exit 2, nothing written."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import ROOT
from core.errors import SmeltError
from core.files import read_safetensors
from models.hf_io import load_hf


def _run(*args: str):
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True,
                          env=os.environ, check=False, timeout=180)


def _one_line_error(proc, *words: str) -> None:
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith("error:") and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    for w in words:
        assert w in proc.stderr, proc.stderr


@pytest.fixture
def truncated_dir(tiny_model_dir):
    f = tiny_model_dir / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return tiny_model_dir


@pytest.fixture
def nan_dir(tiny_model_dir):
    f = tiny_model_dir / "model.safetensors"
    state = load_file(str(f))
    state["model.layers.1.mlp.down_proj.weight"][3, 5] = float("nan")
    save_file(state, str(f), metadata={"format": "pt"})
    return tiny_model_dir


def test_a_truncated_or_non_finite_checkpoint_is_refused_by_name(truncated_dir, tmp_path):
    with pytest.raises(SmeltError, match="model.safetensors is not a readable safetensors file"):
        load_hf(truncated_dir)
    with pytest.raises(SmeltError, match="not a readable"):
        read_safetensors(truncated_dir / "model.safetensors")


def test_nan_weights_are_refused_naming_the_tensor(nan_dir):
    with pytest.raises(SmeltError, match=r"model.layers.1.mlp.down_proj.weight has 1 non-finite"):
        load_hf(nan_dir)


def test_evaluate_cli_on_a_truncated_model_is_one_line(truncated_dir, tmp_path):
    out = tmp_path / "eval.json"
    proc = _run("eval.evaluate", "--model", str(truncated_dir), "--teacher", str(truncated_dir),
                "--windows", "en=1", "--seq-len", "32", "--out", str(out))
    _one_line_error(proc, "model.safetensors", "truncated or corrupt")
    assert not out.exists()


def test_prune_cli_refuses_a_nan_teacher_and_writes_nothing(nan_dir, tmp_path):
    out = tmp_path / "pruned"
    proc = _run("prune.run", "--teacher", str(nan_dir), "--method", "magnitude", "--sparsity", "0.5",
                "--out", str(out))
    _one_line_error(proc, "down_proj.weight", "non-finite")
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".pruned")]


def test_a_bad_flag_is_one_line_too(tiny_model_dir, tmp_path):
    _one_line_error(_run("eval.evaluate", "--no-such-flag"), "unrecognized arguments: --no-such-flag")
    _one_line_error(_run("qat.release", "--artifact", str(tiny_model_dir)), "--out")


@pytest.mark.parametrize("argv, message", [
    (["--seq-len", "0"], "--seq-len 0 must be >= 2"),  # 0 is a value given, not the default
    (["--batch-size", "0"], "--batch-size 0 must be >= 1"),
    (["--windows", "en=0"], "windows >= 1 per bucket"),
])
def test_evaluate_counts_given_as_zero_are_refused(argv, message, tmp_path, capsys):
    from core.errors import run_cli
    from eval.evaluate import main

    with pytest.raises(SystemExit) as e:
        run_cli(lambda: main([*argv, "--out", str(tmp_path / "eval.json")]))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error:") and message in err and err.count("\n") == 1
    assert not (tmp_path / "eval.json").exists()


def test_train_run_started_directly_reports_bad_config_in_one_line(tmp_path):
    """torchtitan users start `torchrun -m train.run` themselves: an unknown config or option, or a config the
    launcher would refuse, is one line from the rank (exit 2) before it logs or writes anything, and torchrun's
    own failure report names that line as its root cause."""
    reg = ["--module", "train.config_registry", "--dump_folder", str(tmp_path / "dump")]
    unknown = "error: unknown option --training.nope (--help lists the options)"
    cases = {
        "config": (["-m", "train.run", *reg, "--config", "nope"],
                   "error: --config 'nope' is not a config of train.config_registry (available: debug_distill, "),
        "key": (["-m", "train.run", *reg, "--config", "debug_distill", "--training.nope", "3"], unknown),
        "student": (["-m", "train.run", *reg, "--config", "debug_distill"],
                    "error: --student '': artifact directory does not exist"),
        "torchrun": (["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m", "train.run", *reg,
                      "--config", "debug_distill", "--training.nope", "3"], unknown),
    }
    procs = {k: subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=os.environ, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE) for k, (argv, _) in cases.items()}
    out = {k: p.communicate(timeout=300) for k, p in procs.items()}
    for k in ("config", "key", "student"):
        stdout, stderr = out[k]
        assert procs[k].returncode == 2, stderr[-2000:]
        assert len(stderr.splitlines()) == 1 and stderr.startswith(cases[k][1]), stderr[-2000:]
        assert "Traceback" not in stdout + stderr
    stderr = out["torchrun"][1]
    assert procs["torchrun"].returncode != 0 and stderr.splitlines()[0] == unknown, stderr[-3000:]
    assert f"traceback : {unknown}" in stderr  # torchrun's root cause: the rank's line, not a pointer to docs
    assert not (tmp_path / "dump").exists()


def test_traceback_on_request(truncated_dir):
    env = {**os.environ, "SMELT_TRACEBACK": "1"}
    proc = subprocess.run([sys.executable, "-m", "eval.evaluate", "--model", str(truncated_dir), "--teacher",
                           str(truncated_dir), "--windows", "en=1", "--seq-len", "32"], cwd=ROOT, env=env,
                          capture_output=True, text=True, check=False, timeout=180)
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_atomic_save_leaves_no_partial_file(tmp_path, monkeypatch):
    import core.files as files

    target = tmp_path / "x.safetensors"
    target.write_bytes(b"old")

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(files, "save_file", boom)
    with pytest.raises(OSError):
        files.atomic_save_safetensors({"a": torch.zeros(2)}, target)
    assert target.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["x.safetensors"]
