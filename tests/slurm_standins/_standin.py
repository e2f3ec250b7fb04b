"""What the Slurm stand-ins (srun, scancel, scontrol, sbatch in this directory) share: the job registry.

No Slurm here, so a directory plays slurmctld: SLURM_STANDIN_DIR (required) holds

    jobs/<JOBID>/batch            pid of the batch shell (written by whoever plays slurmd: the test)
    jobs/<JOBID>/step-<pid>       one line per task pid of a running srun step (written by srun, removed at exit)
    requeued                      one job id per `scontrol requeue`
    scancel.log                   one line per scancel call (its arguments)
    sbatch.jsonl                  one JSON object per submitted job; next_job_id: the counter

A job step's "container" (what slurmstepd signals, src/slurmd/slurmstepd/req.c: proctrack_g_signal) depends on
SLURM_STANDIN_PROCTRACK:
    pgid (default)  the process group of each task, like proctrack/pgid: children that start a new session
                    (torchrun's workers) are not in it;
    cgroup          each task and all its descendants, like proctrack/cgroup.
"""
from __future__ import annotations

import os
import signal
from pathlib import Path


def state_dir() -> Path:
    d = os.environ.get("SLURM_STANDIN_DIR")
    if not d:
        raise SystemExit("slurm stand-in: set SLURM_STANDIN_DIR (the stand-ins' state directory)")
    return Path(d)


def job_dir(job_id: str) -> Path:
    return state_dir() / "jobs" / str(job_id)


def proctrack() -> str:
    mode = os.environ.get("SLURM_STANDIN_PROCTRACK", "pgid")
    if mode not in ("pgid", "cgroup"):
        raise SystemExit(f"slurm stand-in: SLURM_STANDIN_PROCTRACK={mode!r}: pgid or cgroup")
    return mode


def _ppids() -> dict[int, int]:
    out = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            stat = (p / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state ppid ...
        out[int(p.name)] = int(fields[1])
    return out


def descendants(pids: list[int]) -> list[int]:
    """pids and all their living descendants."""
    ppids = _ppids()
    children: dict[int, list[int]] = {}
    for pid, ppid in ppids.items():
        children.setdefault(ppid, []).append(pid)
    seen, todo = [], [p for p in pids if p in ppids]
    while todo:
        p = todo.pop()
        if p not in seen:
            seen.append(p)
            todo.extend(children.get(p, []))
    return seen


def start_time(pid: int) -> int | None:
    """When the process started (clock ticks since boot): with its pid, it names one process, even after reuse."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[19])


def signal_container(task_pids: list[int], sig: int) -> None:
    """Signal a job step's processes the way slurmstepd does (see the module docstring)."""
    if proctrack() == "cgroup":
        for pid in descendants(task_pids):
            _kill(pid, sig)
        return
    for pid in task_pids:
        try:
            os.killpg(os.getpgid(pid), sig)
        except (ProcessLookupError, PermissionError):
            pass


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def steps(job_id: str) -> list[list[int]]:
    """The task pids of each running step of the job."""
    out = []
    for f in sorted(job_dir(job_id).glob("step-*")):
        try:
            out.append([int(x) for x in f.read_text().split()])
        except (OSError, ValueError):
            continue
    return out


def batch_pid(job_id: str) -> int | None:
    try:
        return int((job_dir(job_id) / "batch").read_text())
    except (OSError, ValueError):
        return None


def signal_number(name: str) -> int:
    name = name.upper()
    if name.isdigit():
        return int(name)
    return int(getattr(signal, name if name.startswith("SIG") else "SIG" + name))
