"""Entry point of every training stage (torchtitan's own train.main, plus CPU shims and clean errors).

    torchrun --nproc_per_node=N -m train.run --module train.config_registry --config smollm2_recover \
        --student runs/smollm2/pruned --teacher smollm2-135m --export_dir runs/smollm2/recovered

Any Trainer.Config field can be overridden on the command line (`--training.steps 200`).
"""
from __future__ import annotations

import os
import sys


def _wandb_env() -> None:
    # Offline unless the user configured otherwise; a requeued Slurm job keeps the same wandb run.
    os.environ.setdefault("WANDB_MODE", "offline")
    job = os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ.get("SLURM_JOB_ID")
    if job and "WANDB_RUN_ID" not in os.environ:
        task = os.environ.get("SLURM_ARRAY_TASK_ID", "")
        os.environ["WANDB_RUN_ID"] = f"smelt-{job}{'-' + task if task else ''}"
        os.environ.setdefault("WANDB_RESUME", "allow")
    os.environ.setdefault("WANDB_RUN_NAME", os.environ.get("SLURM_JOB_NAME", "smelt"))
    os.environ.setdefault("WANDB_PROJECT", "smelt")


def main() -> None:
    from train import cpu_shims

    cpu_shims.apply()  # before torchtitan is imported; a no-op when a GPU is present
    _wandb_env()
    import torch
    from torchtitan.config import ConfigManager
    from torchtitan.observability import structured_logger as sl
    from torchtitan.tools.logging import init_logger

    from core.errors import SmeltError
    from train.trainer import TrainingStopped

    trainer = None
    try:
        init_logger()
        config = ConfigManager().parse_args()
        sl.init_structured_logger(source="training", output_dir=config.dump_folder,
                                  enable=config.debug.enable_structured_logging)
        trainer = config.build()
        trainer.train()
    except (SmeltError, TrainingStopped, FileNotFoundError) as e:
        rank = int(os.environ.get("RANK", "0"))
        if rank == 0:
            print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        sys.exit(2)
    finally:
        if trainer is not None:
            trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
