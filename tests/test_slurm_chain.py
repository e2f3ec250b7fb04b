"""The debug recipe on two "nodes": each stage one slurm/stage.sbatch job under the Slurm stand-ins
(tests/slurm_standins), as slurm/chain.sh submits them: the training stages (recover, MTP, QAT) with
SLURM_NNODES=2 and 2 gloo ranks per node, both nodes on this machine meeting at the rendezvous stage.sbatch
exports (4 ranks, FSDP2 shard degree 4); the other stages on one node. During QAT the batch shell gets SIGUSR1
after a checkpointable step: every rank checkpoints and exits 0, the job requeues itself, and the requeued job
(same command and job id, SLURM_RESTART_COUNT=1) resumes from the checkpoint and finishes. The release made from
the resumed QAT must verify.

To keep it short the chain runs only what these need (heads -> prune -> recover -> self-text -> mtp -> quantize ->
qat -> release -> verify): the teacher stage (the teacher is an HF directory already), the stages that fit blocks
again (reconstruct, qreconstruct), the QAT'd model's text and MTP re-alignment, the report and the evaluations are
left out (--set inputs around them; tests/test_own_model.py runs the whole recipe on one node). Most of the time
is the 4 trainings' start (2 launchers and 4 ranks importing torchtitan): ~6 min measured on 2 cores that another
process kept busy.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import ROOT
from test_slurm import Job, _env, _venv

DUMPS = {"recover": "recovered-2of4-run", "mtp": "mtp-2of4-run", "qat": "qat-2of4-run"}  # the trainers' folders
RECIPE = ROOT / "configs" / "recipes" / "debug.toml"
QAT_STEPS = 16  # ~0.5 s each here: room for the signal to travel (batch shell -> scancel -> srun -> task.sh -> ranks)
SIGNAL_AFTER = 2  # a step after the first one that can be checkpointed (step > 0)


@pytest.fixture
def venv(tmp_path):
    """The project's interpreter behind an up-to-date stamp, as the scripts check it (tests/test_slurm.py)."""
    return _venv(tmp_path / "venv")


def _sets(teacher: Path, run: Path) -> list[str]:
    sets = {"teacher": teacher, "run_dir": run,
            "stages.recover.input": "prune", "stages.qat.input": "quantize", "stages.release.input": "qat",
            "stages.release.metrics": "false", "stages.qat.steps": QAT_STEPS}
    for stage in ("prune", "recover", "quantize", "qat"):
        sets[f"stages.{stage}.evaluate"] = "false"
    return [x for k, v in sets.items() for x in ("--set", f"{k}={v}")]


def _rank_logs(dump: Path, tail: int = 2000) -> str:
    """The ranks' own output (train.launch files local ranks > 0 under the dump folder): a failure's last words."""
    return "".join(f"\n----- {log}\n{log.read_text(errors='replace')[-tail:]}"
                   for log in sorted(dump.glob("rank-logs/*/attempt_*/*/*.log")))


def _training_stages(env: dict, sets: list[str]) -> list[str]:
    proc = subprocess.run([env["SMELT_VENV"] + "/bin/python", "-m", "configs.recipe", str(RECIPE), *sets,
                           "--training-stages"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def test_the_debug_recipe_on_two_nodes_resumes_qat_after_usr1_and_verifies(tmp_path, venv, tiny_model_dir):
    started = time.time()
    run, state, logs = tmp_path / "run", tmp_path / "state", tmp_path / "logs"
    logs.mkdir()
    sets = _sets(tiny_model_dir, run)
    job_id = iter(range(2000, 3000))
    times: dict[str, float] = {}

    def env_for(stage: str, nodes: int) -> dict[str, str]:
        return _env(state, venv, next(job_id), SLURM_NNODES=str(nodes), SLURM_JOB_NAME=f"smelt-debug-{stage}")

    def stage_job(stage: str, env: dict[str, str]) -> Job:
        return Job("slurm/stage.sbatch", [RECIPE, stage, *sets], env,
                   logs / f"{env['SLURM_JOB_NAME']}-{env['SLURM_JOB_ID']}.out", tmp_path)

    training = _training_stages(env_for("list", 1), sets)
    assert {"recover", "mtp", "qat"} <= set(training)

    def run_stage(stage: str) -> Job:
        t0 = time.time()
        env = env_for(stage, 2 if stage in training else 1)
        job = stage_job(stage, env)
        rc = job.finish(600)
        ranks = _rank_logs(run / DUMPS[stage]) if stage in DUMPS else ""
        assert rc == 0, f"stage {stage}:\n{job.text()[-6000:]}{ranks}"
        assert env["SLURM_JOB_ID"] not in job.requeued()
        times[stage] = time.time() - t0
        print(f"{stage}: {times[stage]:.0f} s", flush=True)
        return job

    for stage in ("heads", "prune", "recover", "self-text", "mtp", "quantize"):
        job = run_stage(stage)
        if stage in training:  # 2 nodes x 2 ranks: FSDP2 shards over the 4
            assert f"{stage}; 2 node(s) x 2 rank(s), rendezvous localhost:" in job.text()
            assert "dp_shard=4" in job.text() and "trained to step 2" in job.text()

    # QAT, interrupted: SIGUSR1 to the batch shell after a checkpointable step.
    t0 = time.time()
    env = env_for("qat", 2)
    job = stage_job("qat", env)
    dump = run / DUMPS["qat"]
    job.wait_for(rf"step:\s+{SIGNAL_AFTER}\b", timeout=600)
    os.kill(job.proc.pid, signal.SIGUSR1)  # what --signal=B:USR1@N does before the time limit
    assert job.finish(600) == 0, job.text()[-6000:] + _rank_logs(dump)
    first = job.text()
    stopped = [int(s) for s in re.findall(r"stopping at step (\d+) after a signal", first)]
    assert stopped and SIGNAL_AFTER <= min(stopped) < QAT_STEPS, first[-6000:]
    assert len(set(stopped)) == 1, stopped  # every rank stops at the same step
    assert job.requeued() == [env["SLURM_JOB_ID"]] and f"requeueing job {env['SLURM_JOB_ID']}" in first
    qat_out = run / "qat-2of4"
    assert not qat_out.exists()
    ckpt = dump / "checkpoint" / f"step-{stopped[0]}"
    assert (ckpt / ".metadata").is_file(), sorted(p.name for p in ckpt.parent.iterdir())
    shards = sorted(p.name for p in ckpt.glob("*.distcp"))
    assert len(shards) == 4, shards  # every rank of both nodes wrote its part

    # The requeued job: the same command and job id; Slurm counts the restart; its log is appended to.
    again = stage_job("qat", dict(env, SLURM_RESTART_COUNT="1"))
    assert again.finish(600) == 0, again.text()[-6000:] + _rank_logs(dump)
    rerun = again.text()[len(first):]
    assert again.text().startswith(first)  # appended, as --open-mode=append
    assert "(restart 1)" in rerun and f"Loading the checkpoint from {ckpt}." in rerun, rerun[-6000:]
    assert f"Training starts at step {stopped[0] + 1}" in rerun and "fresh start" not in rerun
    assert f"trained to step {QAT_STEPS}" in rerun and again.requeued() == [env["SLURM_JOB_ID"]]  # once
    assert (qat_out / "model.safetensors").is_file() and (qat_out / "qparams.safetensors").is_file()
    # one torchrun per node per job, each filing its ranks' logs
    assert len(list(dump.glob(f"rank-logs/{env['SLURM_JOB_ID']}_*"))) == 4
    times["qat (both jobs)"] = time.time() - t0
    print(f"qat, both jobs: {times['qat (both jobs)']:.0f} s", flush=True)

    run_stage("release")
    verify = run_stage("verify")
    assert "PASSED: 0 failure(s)" in verify.text(), verify.text()[-4000:]
    total = time.time() - started
    print("stage times: " + ", ".join(f"{k} {v:.0f} s" for k, v in times.items()) + f"; total {total:.0f} s")
