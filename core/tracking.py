"""wandb for every stage: one group per recipe run, one run per stage, offline unless asked otherwise.

The run's identity comes from the environment so that every process of a stage (the training ranks,
the stage's evaluation) and a requeued Slurm job land in the same run:

  WANDB_MODE          offline by default; `online` (with WANDB_API_KEY) syncs live; `disabled` turns it off
  WANDB_RUN_GROUP     the recipe run (set by `configs.recipe`)
  WANDB_RUN_ID        the stage's run (set by `configs.recipe`; else derived from the Slurm job id, which
                      a requeued job keeps); resumed with WANDB_RESUME=allow
  WANDB_RUN_JOB_TYPE  the stage kind (recover, qat, evaluate, ...)

Offline runs are written under the stage's folder; a requeued job writes a second offline directory with
the same run id, and `wandb sync` of both directories fills one run.
"""
from __future__ import annotations

import os
from pathlib import Path


def wandb_env() -> None:
    """Defaults for the WANDB_* variables above (values the user set are kept)."""
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_PROJECT", "smelt")
    job = os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ.get("SLURM_JOB_ID")
    if job and "WANDB_RUN_ID" not in os.environ:
        task = os.environ.get("SLURM_ARRAY_TASK_ID", "")
        os.environ["WANDB_RUN_ID"] = f"smelt-{job}{'-' + task if task else ''}"
    if "WANDB_RUN_ID" in os.environ:
        os.environ.setdefault("WANDB_RESUME", "allow")
    os.environ.setdefault("WANDB_RUN_NAME", os.environ.get("WANDB_RUN_ID") or os.environ.get("SLURM_JOB_NAME")
                          or "smelt")


def enabled() -> bool:
    return os.environ.get("WANDB_MODE", "offline") != "disabled"


def log_evaluation(report: dict, out_dir: str | Path, name: str, step: int) -> None:
    """One evaluation's per-bucket metrics (history and summary, under `eval/<bucket>/<metric>`) and its
    table, into the stage's run (resumed if the training ranks opened it first). `step`: the stage's training
    step that made the model (0 when none did), logged as `eval/step` and declared the x-axis of every
    `eval/` metric. The row itself goes at step + 1, after the training rows of the same run: an offline
    process does not know the run's last step, and a row at a step the run already passed is dropped at
    sync."""
    if not enabled():
        return
    import wandb  # here, not at the top: seconds to import, and only this path needs it

    wandb_env()
    os.environ.setdefault("WANDB_RUN_JOB_TYPE", "evaluate")
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    run = wandb.init(dir=str(out_dir), config={"evaluation": report.get("settings", {}), "model": name},
                     reinit="finish_previous")
    cols = ["bucket", "tokens", "ppl", "teacher_ppl", "kl_mean", "kl_p50", "kl_p90", "kl_p99", "kl_max",
            "top1_agree"]
    table = wandb.Table(columns=cols)
    metrics = {}
    for bucket, m in report["buckets"].items():
        table.add_data(bucket, *(m.get(c) for c in cols[1:]))
        metrics.update({f"eval/{bucket}/{c}": m[c] for c in cols[1:] if c in m})
    run.define_metric("eval/step")
    run.define_metric("eval/*", step_metric="eval/step")
    run.log({"eval/step": step, **metrics, "eval/table": table}, step=step + 1)
    run.summary.update(metrics)
    run.finish()
