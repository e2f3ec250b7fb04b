"""Start a training stage: check its config in this process, then start the ranks with torchrun.

    python -m train.launch --nproc 2 -- --module train.config_registry --config smollm2_recover \
        --student runs/smollm2/pruned --teacher smollm2-135m --export_dir runs/smollm2/recovered

Everything after `--` is what every rank's `train.run` gets. First the config is parsed exactly as the
ranks will parse it (train.run.parse_config, CPU shims first) and checked (train.trainer.check_config):
an unknown config or option, a bad value or a missing --student is `error: <one line>` and exit
status 2, instead of a traceback from every rank plus torchrun's failure report. Then this process
becomes (exec: same pid, so Slurm's and the user's signals reach torchrun as before)

    python -m torch.distributed.run --standalone --nproc-per-node N --local-ranks-filter 0 -m train.run ...

On several nodes (Slurm) pass --nnodes, --rdzv-id and --rdzv-endpoint (c10d rendezvous) instead of the
standalone one. Local rank 0's output is the console's; the other local ranks' goes to files,

    <dump_folder>/rank-logs/<run id>_<random>/attempt_<n>/<local rank>/{stdout,stderr}.log

so that a rank that dies alone (a C++ abort, say) leaves its last words behind; --all-ranks shows every
local rank's output on the console instead.
"""
from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path

import torch

from core.errors import ArgumentParser, SmeltError, run_cli
from core.runlock import check_free
from train.run import parse_config

RANK_LOGS = "rank-logs"  # under the dump folder: the other local ranks' stdout/stderr
USAGE = "python -m train.launch [--nproc N] -- --module train.config_registry --config NAME [overrides]"


def _parser() -> ArgumentParser:
    ap = ArgumentParser(prog="python -m train.launch", usage=USAGE, description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", "--nproc-per-node", "--nproc_per_node", dest="nproc", type=int, default=1,
                    help="ranks per node (default 1)")
    ap.add_argument("--nnodes", default="1", help="nodes (torchrun's --nnodes); >1 needs --rdzv-endpoint")
    ap.add_argument("--rdzv-id", "--rdzv_id", dest="rdzv_id", default="smelt")
    ap.add_argument("--rdzv-endpoint", "--rdzv_endpoint", dest="rdzv_endpoint", default="",
                    help="HOST:PORT of the c10d rendezvous (multi-node); default: a standalone one")
    ap.add_argument("--all-ranks", action="store_true", help="show every local rank's output")
    return ap


def torchrun_args(argv: list[str]):
    """(the launcher's options, torchrun's options, train.run's arguments) from its command line."""
    i = argv.index("--") if "--" in argv else len(argv)
    opts = _parser().parse_args(argv[:i])  # before the check below, so that --help works alone
    if i == len(argv):
        raise SmeltError(f"put the train.run arguments after --: {USAGE}")
    if opts.nproc < 1:
        raise SmeltError(f"--nproc {opts.nproc} must be >= 1")
    out = [f"--nproc-per-node={opts.nproc}"]
    if opts.rdzv_endpoint:
        out += [f"--nnodes={opts.nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={opts.rdzv_endpoint}",
                f"--rdzv-id={opts.rdzv_id}"]
    elif opts.nnodes != "1":
        raise SmeltError(f"--nnodes {opts.nnodes} needs --rdzv-endpoint HOST:PORT")
    else:
        out.append("--standalone")
    if not opts.all_ranks:
        out += ["--local-ranks-filter", "0"]
    return opts, out, argv[i + 1:]


def check_world(config, nproc: int, nnodes: str) -> None:
    """What only the launcher knows: the ranks it will start against the GPUs and the batch."""
    if torch.cuda.is_available() and nproc > torch.cuda.device_count():
        raise SmeltError(f"--nproc {nproc}: this node has {torch.cuda.device_count()} GPU(s)")
    alloc = os.environ.get("SLURM_GPUS_ON_NODE")
    if alloc and alloc.isdigit() and torch.cuda.is_available() and nproc > int(alloc):
        raise SmeltError(f"--nproc {nproc}: the Slurm allocation has {alloc} GPU(s) per node")
    if not nnodes.isdigit():
        return  # an elastic range (min:max): the world size is known only at rendezvous
    world = nproc * int(nnodes)
    par = config.parallelism
    model_par = par.tensor_parallel_degree * par.pipeline_parallel_degree * par.context_parallel_degree
    if world % model_par:
        raise SmeltError(f"{world} ranks do not divide by tensor x pipeline x context parallel = {model_par}")
    dp, tr = world // model_par, config.training
    if tr.global_batch_size > 0 and tr.global_batch_size % (tr.local_batch_size * dp):
        raise SmeltError(f"--training.global_batch_size {tr.global_batch_size} is not a multiple of "
                         f"--training.local_batch_size {tr.local_batch_size} x data-parallel degree {dp}")


def main() -> None:
    opts, torchrun, run_args = torchrun_args(sys.argv[1:])
    # The ranks print the parse's warnings themselves; here only a failure is reported (one line).
    with contextlib.redirect_stderr(io.StringIO()):
        config = parse_config(run_args)
        # Here, not at the top: train.trainer imports torchtitan, which parse_config's shims must precede.
        from train.trainer import check_config

        check_config(config)
    check_world(config, opts.nproc, opts.nnodes)
    check_free(config.dump_folder)  # a live run on this folder: refused before any rank starts
    if not opts.all_ranks and opts.nproc > 1:  # torchrun makes a fresh subfolder per launch: a requeue keeps both
        torchrun += ["--log-dir", str(Path(config.dump_folder) / RANK_LOGS),
                     "--redirects", ",".join(f"{r}:3" for r in range(1, opts.nproc))]
    cmd = [sys.executable, "-m", "torch.distributed.run", *torchrun, "-m", "train.run", *run_args]
    sys.stdout.flush()
    sys.stderr.flush()
    os.environ["SMELT_LAUNCHER_PID"] = str(os.getpid())  # the ranks' parent after the exec: see train.run
    os.execv(sys.executable, cmd)


if __name__ == "__main__":
    run_cli(main)
