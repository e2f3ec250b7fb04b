"""What each training rank runs: torchtitan's train.main, plus CPU shims and one-line errors.

Start it through the launcher, which checks the config before any rank starts:

    python -m train.launch --nproc 2 -- --module train.config_registry --config smollm2_recover \
        --student runs/smollm2/pruned --teacher smollm2-135m --export_dir runs/smollm2/recovered

Any Trainer.Config field can be overridden on the command line (`--training.steps 200`).
`parse_config` is the one parse both use: bad input (unknown config or option, a bad value) is a
SmeltError with a one-line message. Started directly (`torchrun -m train.run ...`, as torchtitan is), each
rank parses and checks its config (`checked_config`, what the launcher runs) before it logs, writes or
joins anything, so bad input is still `error: <one line>` from rank 0 and exit status 2 from every rank.
torchrun then prints its own failure report (its process, not a rank's); the line is also written to
torchrun's error file, so that report's root cause is that line. `train.launch` reports it alone.
"""
from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import inspect
import io
import json
import logging
import os
import signal
import sys
import time
from types import ModuleType

import torch

from core.errors import SmeltError, one_line, run_cli
from core.tracking import wandb_env
from train import cpu_shims

try:  # tyro's parse-error hook (private, experimental); without it the error box is shortened instead
    from tyro import _errors as tyro_errors
except ImportError:  # pragma: no cover
    tyro_errors = None


def exit_with_launcher(sig: int = signal.SIGTERM) -> None:
    """Have the kernel send `sig` to this rank when its parent (torchrun) dies, even by kill -9.

    SIGTERM takes the trainer's checkpoint-and-exit path, so an orphaned rank saves its step and stops
    instead of training on into a dump folder that a resumed run may already be using.
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_PDEATHSIG = 1
    libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    launcher = os.environ.get("SMELT_LAUNCHER_PID")  # train.launch's pid, which torchrun keeps (exec)
    orphaned = os.getppid() != int(launcher) if launcher else os.getppid() == 1
    if orphaned:  # the launcher died before prctl ran
        os.kill(os.getpid(), sig)


def config_names(module: ModuleType) -> list[str]:
    """The config functions a registry module defines (not the helpers it imports, not _private ones)."""
    return [n for n, f in vars(module).items()
            if inspect.isfunction(f) and f.__module__ == module.__name__ and not n.startswith("_")]


def _option(args: list[str], name: str) -> str | None:
    """The value of `name X` / `name=X` in args (the last one, as ConfigManager reads them)."""
    value = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


def _registry(module_name: str) -> ModuleType | None:
    """The module ConfigManager would load for --module (X.config_registry, else X); None if neither
    exists (ConfigManager then tries torchtitan's own short names and reports the failure)."""
    for candidate in (f"{module_name}.config_registry", module_name):
        try:
            return importlib.import_module(candidate)
        except ModuleNotFoundError as e:
            if not (e.name and (candidate == e.name or candidate.startswith(e.name + "."))):
                raise  # the module exists but something it imports does not: a real failure
    return None


def _check_config_name(args: list[str]) -> None:
    module_name, config_name = _option(args, "--module"), _option(args, "--config")
    module = _registry(module_name) if module_name else None
    if module is None or config_name is None:
        return
    names = config_names(module)
    if config_name not in names:
        raise SmeltError(f"--config {config_name!r} is not a config of {module.__name__} "
                         f"(available: {', '.join(names)})")


def _flag(argument) -> str:
    flags = getattr(getattr(argument, "lowered", None), "name_or_flags", None)
    return "/".join(flags) if flags else "an option"


def _on_tyro_error(event) -> None:
    """Turn tyro's parse failures into SmeltError (raising here stops tyro's error box and exit)."""
    if isinstance(event, tyro_errors.UnrecognizedArgs):
        opts = [t for t in event.tokens if t.startswith("-")] or event.tokens
        raise SmeltError(f"unknown option{'s' if len(opts) > 1 else ''} {', '.join(opts)} "
                         f"(--help lists the options)")
    if isinstance(event, tyro_errors.InvalidChoice):
        raise SmeltError(f"{_flag(event.argument)} {event.value!r} is not one of {', '.join(event.choices)}")
    if isinstance(event, tyro_errors.InstantiationFailure):
        raise SmeltError(f"{_flag(event.argument)}: {one_line(ValueError(event.message))}")
    if isinstance(event, tyro_errors.BadValue):
        raise SmeltError(f"{_flag(event.argument)}: bad value {event.offending_value or '(missing)'}")
    # Any other event: tyro prints its box (captured by parse_config) and exits 2.


def _box_message(text: str) -> str:
    """The gist of a tyro error box: its title and first line of content."""
    lines = [ln.strip(" │╭╮╰╯─") for ln in text.splitlines()]
    lines = [ln for ln in lines if ln]
    return ": ".join(lines[:2]) or "the command line could not be parsed"


def parse_config(args: list[str]):
    """torchtitan's ConfigManager().parse_args(args), with the CPU shims applied first and bad input as
    SmeltError. What it printed to stderr is passed on only when parsing succeeds."""
    cpu_shims.apply()
    # Here, not at the top: torchtitan reads the device type when first imported (after the shims).
    from torchtitan.config import ConfigManager

    _check_config_name(args)
    err = io.StringIO()
    hook = tyro_errors.on_parse_error(_on_tyro_error) if tyro_errors else contextlib.nullcontext()
    try:
        with contextlib.redirect_stderr(err), hook:
            config = ConfigManager().parse_args(args)
    except SystemExit as e:
        if e.code in (0, None):  # --help
            raise
        raise SmeltError(_box_message(err.getvalue())) from None
    except (ValueError, ImportError) as e:  # ConfigManager's own: --module/--config missing, no such module
        raise SmeltError(one_line(e)) from None
    sys.stderr.write(err.getvalue())
    return config


def checked_config(args: list[str]):
    """parse_config, then the checks that need no model or process group (train.trainer.check_config).
    What they print to stderr (torchtitan's warnings) is passed on only when both pass."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        config = parse_config(args)
        # Here, not at the top: train.trainer imports torchtitan, which parse_config's shims must precede.
        from train.trainer import check_config

        check_config(config)
    sys.stderr.write(err.getvalue())
    return config


def _tell_torchrun(e: Exception) -> None:
    """Write a rank's one-line error where torchrun reads a failed rank's error (its report's root cause)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path and isinstance(e, (SmeltError, ValueError, FileNotFoundError)):  # what run_cli reports in one line
        line = f"error: {one_line(e)}"
        with contextlib.suppress(OSError), open(path, "w") as f:
            json.dump({"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                                  "timestamp": str(int(time.time()))}}}, f)


def _barrier() -> None:
    """All ranks meet before teardown; NCCL is told its device (guessing it warns, and can pick the wrong one)."""
    nccl = torch.cuda.is_available() and "nccl" in str(torch.distributed.get_backend())
    torch.distributed.barrier(device_ids=[torch.cuda.current_device()] if nccl else None)


def main() -> None:
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun worker: its launcher's death is its own
        exit_with_launcher()
    cpu_shims.apply()  # before torchtitan is imported; a no-op when a GPU is present
    wandb_env()
    # Here, not at the top: these import torchtitan, which must come after the shims.
    from torchtitan.observability import structured_logger as sl
    from torchtitan.tools.logging import init_logger

    def train() -> None:
        trainer, finished = None, False
        try:
            # Checked before the logger starts: torchtitan's warnings while parsing stay with a failed parse.
            config = checked_config(sys.argv[1:])
            init_logger()
            sl.init_structured_logger(source="training", output_dir=config.dump_folder,
                                      enable=config.debug.enable_structured_logging)
            trainer = config.build()
            trainer.train()
            finished = True
        except Exception as e:
            _tell_torchrun(e)
            raise
        finally:
            if trainer is not None:
                trainer.close()
                # Free the model (and the gloo work objects its FSDP hooks hold) while the interpreter lives.
                trainer = None
                gc.collect()
            if torch.distributed.is_initialized():
                if finished:  # rank 0 still exports and closes wandb: no rank may tear its links down first
                    _barrier()
                torch.distributed.destroy_process_group()

    run_cli(train, show=int(os.environ.get("RANK", "0")) == 0)
    _exit_clean()


def _exit_clean() -> None:
    """Leave a finished rank without interpreter finalization.

    Everything is saved and the process group is gone, but c10d caches can keep a gloo group alive
    until finalization, and freeing its worker threads' tensors then needs a GIL that no longer
    exists: the rank aborted (SIGABRT, "terminate called without an active exception") after a
    complete run, in CI. os._exit skips that teardown; the streams are flushed first.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
