"""The real trainer path: torchtitan Trainer, 2 gloo processes, FSDP2 shard degree 2, through the CPU shims.

Covers distillation with masks kept, bit-identical resume after kill -9, checkpoint-on-signal, the
NaN stop, and the launcher's one-line refusal of a bad config. Each torchrun takes ~10 s on 2 cores, so
the runs are shared through module fixtures.
"""
from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import (
    ROOT,
    check_offline_export,
    launch_log,
    make_byte_tokenizer,
    make_distill_dirs,
    tiny_config,
)
from safetensors.torch import load_file

from core.masks import load_masks, save_masks
from models.hf_io import load_hf, save_hf
from models.llama import build_model
from train.masks import MaskSet

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            "--local-ranks-filter", "0", "-m", "train.run", "--module", "train.config_registry",
            "--config", "debug_distill"]
# The same run through the launcher, which checks the config before starting torchrun with these options.
LAUNCH = [sys.executable, "-m", "train.launch", "--nproc", "2", "--", "--module", "train.config_registry",
          "--config", "debug_distill"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return make_distill_dirs(tmp_path_factory.mktemp("trainer"))


def _mk(p: Path) -> Path:
    p.mkdir(parents=True)
    return p


def _env():
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    env.pop("SLURM_JOB_ID", None)
    return env


def torchrun(dirs: Path, name: str, *extra: str, timeout: int = 240, config: str = "debug_distill"
             ) -> subprocess.CompletedProcess:
    cmd = LAUNCH[:-1] + [config, "--student", str(dirs / "student"), "--teacher", str(dirs / "teacher"),
                         "--dump_folder", str(dirs / name), "--export_dir", str(dirs / f"{name}-out"), *extra]
    return subprocess.run(cmd, check=False, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)


def _kl_to_teacher(dirs: Path, model_dir: Path) -> float:
    from core.data import EvalConfig
    from eval.evaluate import evaluate

    report = evaluate(load_hf(model_dir), dirs / "teacher", EvalConfig(seq_len=32, windows={"en": 8}),
                      tokenizer=make_byte_tokenizer(), progress=False)
    return report["buckets"]["en"]["kl_mean"]


def _ranks_of(folder: Path) -> list[int]:
    """pids of live train.run processes working on `folder`."""
    pids = []
    for d in Path("/proc").iterdir():
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"train.run" in cmd and str(folder).encode() in cmd:
            pids.append(int(d.name))
    return pids


def _kill_run(proc: subprocess.Popen, folder: Path) -> None:
    """SIGKILL to the ranks working on `folder`, then to torchrun; returns once none is left."""
    for pid in _ranks_of(folder):
        os.kill(pid, signal.SIGKILL)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 30
    while _ranks_of(folder) and time.time() < deadline:
        time.sleep(0.05)


def distill_straight(dirs: Path) -> SimpleNamespace:
    """8 uninterrupted distillation steps of dirs/student: the run other runs are compared with (and the
    distilled student the MTP tests train modules on)."""
    proc = torchrun(dirs, "straight", "--training.steps", "8")
    assert proc.returncode == 0, launch_log(proc)
    return SimpleNamespace(out=dirs / "straight-out", log=proc.stdout + proc.stderr)


@pytest.fixture(scope="module")
def straight_run(dirs):
    return distill_straight(dirs)


def test_distillation_recovers_and_keeps_masks(dirs, straight_run):
    out = straight_run.out
    # The step log's memory figure is the process's peak RSS on CPU (not torchtitan's -0.00GiB).
    mem = [float(m) for m in re.findall(r"memory:\s*(-?[0-9.]+)GiB", straight_run.log)]
    assert mem and min(mem) > 0, straight_run.log[-2000:]
    assert {"model.safetensors", "masks.safetensors", "manifest.json", "tokenizer.json"} <= {
        p.name for p in out.iterdir()}
    masks = load_masks(out)
    assert len(masks) == 4
    trained = load_hf(out)
    assert MaskSet(trained, masks).violations() == 0  # removed weights are still exactly zero
    start = load_hf(dirs / "student")
    moved = (trained.layers["0"].feed_forward.w1.weight - start.layers["0"].feed_forward.w1.weight).abs()
    assert moved.max() > 0  # kept weights did train
    assert _kl_to_teacher(dirs, out) < 0.7 * _kl_to_teacher(dirs, dirs / "student")
    # The teacher is neither trained nor saved: no teacher tensors in the student's DCP checkpoint.
    ckpt = dirs / "straight" / "checkpoint" / "step-8"
    meta = (ckpt / ".metadata").read_bytes()
    assert b"teacher" not in meta and b"inner.layers.0.feed_forward.w1.weight" in meta
    check_offline_export(ckpt, out, dirs / "straight-offline")  # the same artifact from the checkpoint


def kill_after_checkpoint(dirs: Path, name: str, *extra: str, seed: int = 0) -> None:
    """Start a run and SIGKILL it (launcher and ranks together, hard: each rank is its own session) once its
    checkpoint of step 2 or 4 (seeded choice) is on disk; nothing exported."""
    cmd = TORCHRUN + ["--student", str(dirs / "student"), "--teacher", str(dirs / "teacher"),
                      "--dump_folder", str(dirs / name), "--export_dir", str(dirs / f"{name}-out"), *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    target = dirs / name / "checkpoint" / f"step-{random.Random(seed).choice([2, 4])}" / ".metadata"
    deadline = time.time() + 180
    while not target.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    _kill_run(proc, dirs / name)
    assert target.exists() and not (dirs / f"{name}-out").exists()


def test_resume_after_kill9_is_bit_identical(dirs, straight_run):
    name = "killed"
    kill_after_checkpoint(dirs, name, "--training.steps", "8")
    resumed = torchrun(dirs, name, "--training.steps", "8")
    assert resumed.returncode == 0, launch_log(resumed)
    assert "Loading the checkpoint" in resumed.stdout + resumed.stderr
    a = load_file(str(straight_run.out / "model.safetensors"))
    b = load_file(str(dirs / f"{name}-out" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_activation_checkpointing_is_switchable_and_exact(dirs, straight_run):
    # torchtitan's switch, on our model: recomputing each block in backward changes nothing on CPU.
    proc = torchrun(dirs, "full-ac", "--training.steps", "8", "activation_checkpoint:full")
    assert proc.returncode == 0, launch_log(proc)
    assert "every block is recomputed in backward" in proc.stdout + proc.stderr
    a = load_file(str(straight_run.out / "model.safetensors"))
    b = load_file(str(dirs / "full-ac-out" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sigterm_checkpoints_and_exits_within_30s(dirs):
    name = "preempted"
    cmd = TORCHRUN + ["--student", str(dirs / "student"), "--teacher", str(dirs / "teacher"),
                      "--dump_folder", str(dirs / name), "--training.steps", "100000",
                      "--checkpoint.interval", "100000"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    for line in proc.stdout:  # wait until training is really stepping
        if "step:  3" in line:
            break
    sent = time.time()
    os.killpg(proc.pid, signal.SIGTERM)  # what Slurm does to every task before time-out/preemption
    try:
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert time.time() - sent < 30
    steps = [p for p in (dirs / name / "checkpoint").glob("step-*") if (p / ".metadata").exists()]
    assert len(steps) == 1 and int(steps[0].name.split("-")[1]) >= 3  # saved on the signal only


def test_one_live_run_per_dump_folder_and_ranks_stop_with_their_launcher(dirs):
    name = "locked"
    folder = dirs / name
    cmd = LAUNCH[:-1] + ["debug_distill", "--student", str(dirs / "student"), "--teacher", str(dirs / "teacher"),
                         "--dump_folder", str(folder), "--training.steps", "100000",
                         "--checkpoint.interval", "100000"]
    first = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)
    log = []
    for line in first.stdout:  # wait until training is really stepping
        log.append(line)
        if "step:  2" in line:
            break
    drain = threading.Thread(target=lambda: log.extend(first.stdout), daemon=True)
    drain.start()
    try:
        second = torchrun(dirs, name, "--training.steps", "8")
        lines = second.stderr.splitlines()
        assert second.returncode == 2 and len(lines) == 1, second.stderr[-2000:]
        assert f"--dump_folder {folder} is in use by a live run (pid " in lines[0]
        # kill -9 of the launcher alone (it exec'd torchrun: same pid) must not leave its ranks training.
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        deadline = time.time() + 60
        while _ranks_of(folder) and time.time() < deadline:
            time.sleep(0.2)
        assert not _ranks_of(folder), "".join(log)[-3000:]
    finally:
        for pid in _ranks_of(folder):
            os.kill(pid, signal.SIGKILL)
    saved = [p for p in (folder / "checkpoint").glob("step-*") if (p / ".metadata").exists()]
    assert len(saved) == 1, "".join(log)[-3000:]  # the orphaned ranks checkpointed their step, then stopped
    # The dead run's lock is taken over: the same folder resumes and finishes.
    step = int(saved[0].name.split("-")[1])
    third = torchrun(dirs, name, "--training.steps", str(step + 1))
    assert third.returncode == 0, launch_log(third)
    assert "Loading the checkpoint" in third.stdout + third.stderr


def test_the_stop_file_checkpoints_and_exits_like_a_signal(dirs, tmp_path):
    # slurm/task.sh touches $SMELT_STOP_FILE on SIGUSR1: it works even when the ranks ignored the signal.
    stop = tmp_path / "stop"
    cmd = LAUNCH[:-1] + ["debug_distill", "--student", str(dirs / "student"), "--teacher", str(dirs / "teacher"),
                         "--dump_folder", str(dirs / "stopfile"), "--training.steps", "100000",
                         "--checkpoint.interval", "100000"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(_env(), SMELT_STOP_FILE=str(stop)), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    for line in proc.stdout:
        if "step:  2" in line:
            stop.touch()
            break
    try:
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            _kill_run(proc, dirs / "stopfile")
    assert proc.returncode == 0
    steps = [p for p in (dirs / "stopfile" / "checkpoint").glob("step-*") if (p / ".metadata").exists()]
    assert len(steps) == 1 and int(steps[0].name.split("-")[1]) >= 2


def test_nan_loss_stops_with_a_message_and_keeps_the_checkpoint(dirs):
    # A huge learning rate blows the weights up after the first steps -> non-finite loss/gradients.
    proc = torchrun(dirs, "nan", config="debug_diverge")
    assert proc.returncode != 0
    msg = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: step")]
    assert msg and "NaN/inf" in msg[0], proc.stderr[-2000:]
    bad_step = int(msg[0].split()[2].rstrip(":"))
    saved = sorted(int(p.name.split("-")[1]) for p in (dirs / "nan" / "checkpoint").glob("step-*")
                   if (p / ".metadata").exists())
    assert saved and max(saved) == bad_step - 1  # the last good step is kept, the bad one never saved
    assert not (dirs / "nan-out").exists()


def test_mask_set_keeps_weights_zero_through_adamw():
    model = build_model(tiny_config(), seed=0)
    w = model.layers["0"].feed_forward.w3.weight
    keep = torch.rand(w.shape, generator=torch.Generator().manual_seed(0)) > 0.5
    with torch.no_grad():
        w.mul_(keep)
    masks = MaskSet(model, {"layers.0.feed_forward.w3": keep})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    opt.register_step_post_hook(lambda *a: masks.apply_to_weights())
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 16))
    for _ in range(5):
        opt.zero_grad()
        model(tokens).logsumexp(-1).mean().backward()
        masks.apply_to_grads()
        assert w.grad[~keep].abs().max() == 0
        opt.step()
    assert masks.violations() == 0 and (w[keep] != 0).all()
    with torch.no_grad():
        w.add_(1.0)
    assert masks.violations() == int((~keep).sum())


def test_bad_trainer_config_is_refused(dirs, tmp_path):
    from train import cpu_shims

    cpu_shims.apply()
    from core.errors import SmeltError
    from distill.losses import DistillLossConfig
    from train.config_registry import debug_distill
    from train.trainer import SmeltTrainer

    with pytest.raises(SmeltError, match="kind='kld'"):
        DistillLossConfig(kind="kld")
    cfg = debug_distill()
    cfg.student = str(tmp_path / "missing")
    with pytest.raises(SmeltError, match="--student .* does not exist"):
        SmeltTrainer(cfg)
    cfg = debug_distill()
    cfg.student, cfg.dump_folder = str(dirs / "student"), str(tmp_path / "run")
    cfg.checkpoint.load_step = 5
    with pytest.raises(SmeltError, match="--checkpoint.load_step 5: no checkpoint"):
        SmeltTrainer(cfg)
    other = build_model(tiny_config(vocab_size=300), seed=0)
    save_hf(other, _mk(tmp_path / "t300"))
    cfg = debug_distill()
    cfg.student, cfg.teacher = str(dirs / "student"), str(tmp_path / "t300")
    with pytest.raises(SmeltError, match="vocab_size 300 != --student vocab_size 260"):
        SmeltTrainer(cfg)
    cfg = debug_distill()
    cfg.student, cfg.teacher = str(dirs / "student"), str(tmp_path / "no-teacher")
    with pytest.raises(SmeltError, match="--teacher: teacher .*no-teacher.* is neither"):
        SmeltTrainer(cfg)


def test_an_export_longer_than_the_training_timeout_finishes_on_two_ranks(dirs):
    """Rank 0's write outlasts comm.train_timeout_seconds while rank 1 waits for it (the stand-in sleeps in
    rank 0's write_artifact): the end of a stage runs under export_timeout_seconds, so nobody aborts."""
    env = dict(_env(), PYTHONPATH=f"{ROOT}:{ROOT / 'tests' / 'slow_export'}", SMELT_TEST_EXPORT_DELAY="25")
    cmd = LAUNCH[:-1] + ["debug_distill", "--student", str(dirs / "student"), "--teacher", str(dirs / "teacher"),
                         "--dump_folder", str(dirs / "slow"), "--export_dir", str(dirs / "slow-out"),
                         "--training.steps", "2", "--comm.train_timeout_seconds", "10"]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, launch_log(proc)
    assert (dirs / "slow-out" / "model.safetensors").is_file()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_qat_through_the_trainer_keeps_2of4_and_exports_on_grid(dirs, tmp_path, dtype):
    # bfloat16: bf16 compute, the fake quantization on fp32 weights (tests/test_sharded_load.py checks how).
    from core.patterns import NMPattern
    from qat.qparams import read_qparams

    student = load_hf(dirs / "teacher")
    masks = {}
    with torch.no_grad():
        for name, mod in student.named_modules():
            if isinstance(mod, torch.nn.Linear) and name not in ("output",):
                keep = NMPattern(2, 4).keep_top(mod.weight.abs())
                mod.weight.mul_(keep)
                masks[name] = keep
    save_hf(student, _mk(tmp_path / "s24"), tokenizer=make_byte_tokenizer())
    save_masks(student, masks, tmp_path / "s24")
    cmd = TORCHRUN[:-1] + ["debug_qat", "--student", str(tmp_path / "s24"), "--teacher", str(dirs / "teacher"),
                           "--dump_folder", str(tmp_path / "run"), "--export_dir", str(tmp_path / "out"),
                           "--training.mixed_precision_param", dtype]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, launch_log(proc)
    steps = max(int(p.name.split("-")[1]) for p in (tmp_path / "run" / "checkpoint").iterdir())
    check_offline_export(tmp_path / "run" / "checkpoint" / f"step-{steps}", tmp_path / "out", tmp_path / "offline")
    out = load_hf(tmp_path / "out")
    qparams, spec = read_qparams(tmp_path / "out")
    assert spec.group_size == 32 and len(qparams) == len(masks)
    exported = load_masks(tmp_path / "out")
    assert set(exported) == set(masks)
    for name, mod in out.named_modules():
        if name in masks:
            w = mod.weight.detach()
            assert torch.equal(exported[name], masks[name])  # the masks travel unchanged
            assert not bool(w[~masks[name]].any())  # every removed weight is still exactly zero
            assert NMPattern(2, 4).holds(w)  # still 2:4 after QAT
            scale = qparams[name][0].repeat_interleave(32, dim=1)
            q = w / scale
            assert (q - q.round()).abs().max() < 1e-3 and q.round().abs().max() <= 8  # on the int4 grid


@pytest.mark.parametrize("args, named", [
    (["--config", "no_such_config"], "'no_such_config'"),
    (["--config", "debug_distill", "--training.foo", "1"], "--training.foo"),
    (["--config", "debug_distill", "--training.global_batch_size", "3"],
     "--training.global_batch_size 3 is not a multiple of --training.local_batch_size 2 x data-parallel degree 2"),
    (["--config", "debug_distill", "--teacher", "/nonexistent/teacher"], "--teacher: "),
    (["--config", "debug_distill", "activation_checkpoint:selective"], "activation checkpointing policy SelectiveAC is not supported"),
], ids=["unknown-config", "unknown-key", "global-batch", "missing-teacher", "selective-ac"])
def test_bad_launch_is_one_line_before_any_rank_starts(dirs, tmp_path, args, named):
    subcommands = [a for a in args if a.startswith("activation_checkpoint:")]  # tyro: after the options
    cmd = LAUNCH[:-2] + [a for a in args if a not in subcommands] + [
        "--student", str(dirs / "student"), "--dump_folder", str(tmp_path / "run"), *subcommands]
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and named in lines[0], proc.stderr[-2000:]
    if "no_such_config" in named:  # only the registry's own config functions are offered
        assert "debug_distill" in lines[0] and "parallelize" not in lines[0] and "default_adamw" not in lines[0]
    assert not (tmp_path / "run").exists()  # no rank ever started


def test_wandb_offline_run_holds_training_and_evaluation_and_survives_a_requeue(dirs):
    from wandb_records import read_run

    name = "tracked"
    env = dict(_env(), WANDB_MODE="offline", SLURM_JOB_ID="4242", WANDB_RUN_GROUP="recipe-x",
               WANDB_RUN_JOB_TYPE="recover", PYTHONPATH=f"{ROOT}:{ROOT / 'tests'}")
    base = LAUNCH[:-1] + ["debug_distill", "--student", str(dirs / "student"), "--teacher", str(dirs / "teacher"),
                          "--dump_folder", str(dirs / name), "--export_dir", str(dirs / f"{name}-out")]
    for steps in ("2", "4"):  # the second run is the requeued job: same job id, resumes from step 2
        proc = subprocess.run(base + ["--training.steps", steps], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=240, check=False)
        assert proc.returncode == 0, launch_log(proc)
    # Rank 1's output was filed (the console shows rank 0's): one folder per launch, the requeue's too.
    rank1 = sorted((dirs / name / "rank-logs").glob("*/attempt_0/1/stdout.log"), key=lambda f: f.stat().st_mtime)
    assert [("rank 1 trained to step " + s) in log.read_text() for log, s in zip(rank1, "24")] == [True, True]
    report = dirs / f"{name}-out" / "eval.json"
    proc = subprocess.run([sys.executable, "-m", "eval.evaluate", "--model", str(dirs / f"{name}-out"),
                           "--teacher", str(dirs / "teacher"), "--windows", "en=2", "--seq-len", "32",
                           "--out", str(report), "--wandb"], cwd=ROOT, env=env, capture_output=True, text=True, check=False,
                          timeout=240)
    assert proc.returncode == 0, launch_log(proc)
    files = sorted(dirs.glob(f"{name}*/**/offline-run-*/run-*.wandb"))
    runs = [read_run(f) for f in files]
    assert len(runs) == 3 and {r["run"]["id"] for r in runs} == {"smelt-4242"}  # one run, resumed twice
    assert {r["run"]["group"] for r in runs} == {"recipe-x"}
    train_rows = [row for r in runs for row in r["history"] if "loss_metrics/global_avg_loss" in row]
    assert sorted(row["_step"] for row in train_rows) == [1, 2, 3, 4]  # the requeued run continued at 3
    for key in ("lr/AdamW", "throughput(tps)", "loss_metrics/kd", "grad_norm"):  # lr: torchtitan's, per optimizer
        assert any(key in row for r in runs for row in r["history"]), key
    evaluated = json.loads(report.read_text())["buckets"]["en"]
    summary = runs[-1]["summary"] if "eval/en/kl_mean" in runs[-1]["summary"] else {
        k: v for r in runs for k, v in r["summary"].items()}
    assert summary["eval/en/kl_mean"] == pytest.approx(evaluated["kl_mean"])
    assert summary["eval/table/nrows"] == 1
    # the evaluation's row carries the stage's step (the export's, 4) and comes after every training row, so a
    # sync cannot drop it as out of order
    (row,) = [row for r in runs for row in r["history"] if "eval/en/kl_mean" in row]
    assert row["eval/step"] == 4 and row["_step"] == 5 > max(t["_step"] for t in train_rows)


def test_launcher_refuses_more_ranks_than_the_node_or_the_allocation_has(monkeypatch):
    from train import cpu_shims

    cpu_shims.apply()
    from core.errors import SmeltError
    from train.config_registry import debug_distill
    from train.launch import check_world

    cfg = debug_distill()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    with pytest.raises(SmeltError, match="--nproc 8: this node has 4 GPU"):
        check_world(cfg, 8, "1")
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "2")
    with pytest.raises(SmeltError, match="--nproc 4: the Slurm allocation has 2 GPU"):
        check_world(cfg, 4, "1")
    check_world(cfg, 2, "2")  # 2 nodes x 2 ranks: fine
