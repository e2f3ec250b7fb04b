# shellcheck shell=bash
# Shared by slurm/train.sbatch, slurm/stage.sbatch, slurm/submit.sh and slurm/chain.sh (sourced, not run).
# See slurm/README.md for how the pieces fit.

smelt_die() {  # one line on stderr, exit 2 (the project's CLI convention)
  echo "error: $*" >&2
  exit 2
}

# The virtual environment is built once, on the login node (scripts/env.sh); jobs only check it
# (scripts/env.sh --check: the same stamp the install writes). Sets SMELT_PYTHON.
smelt_check_venv() {
  local root=$1
  bash "$root/scripts/env.sh" --check || exit 2  # one line on stderr when missing or stale
  # shellcheck disable=SC2034  # read by the scripts that source this file
  SMELT_PYTHON=${SMELT_VENV:-$root/.venv}/bin/python
}

# The environment every process of the job inherits; each variable is kept if already set:
#   PYTHONFAULTHANDLER=1               a rank that crashes, or is killed on a collective timeout, prints its
#                                      Python stacks in the job log
#   TORCH_NCCL_ASYNC_ERROR_HANDLING=1  an NCCL error or timeout aborts the rank (torchrun then stops the rest)
#                                      instead of leaving it hung until the time limit
#   NCCL_DEBUG=WARN                    NCCL's warnings in the job log, not its info lines
#   WANDB_MODE=offline                 WANDB_MODE=online (and WANDB_API_KEY) to sync live
#   SMELT_OFFLINE=1                    nothing downloads: what is not cached is a one-line error naming it and
#                                      `smelt prefetch RECIPE` (run on the login node); SMELT_OFFLINE=0 to allow
#   HF_HUB_OFFLINE, HF_DATASETS_OFFLINE  the hub clients likewise: SMELT_OFFLINE's value unless set
smelt_job_env() {
  export PYTHONFAULTHANDLER=${PYTHONFAULTHANDLER:-1}
  export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
  export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
  export WANDB_MODE=${WANDB_MODE:-offline}
  export SMELT_OFFLINE=${SMELT_OFFLINE:-1}
  export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-$SMELT_OFFLINE}
  export HF_DATASETS_OFFLINE=${HF_DATASETS_OFFLINE:-$SMELT_OFFLINE}
}

# The multi-node rendezvous from the allocation. Exports what train.launch needs on every node:
#   SMELT_NNODES         nodes (SLURM_NNODES)
#   SMELT_NPROC          ranks per node: $1 if given, else SMELT_NPROC, else SLURM_GPUS_ON_NODE
#   SMELT_RDZV_ENDPOINT  HOST:PORT, the job's first node; PORT = SMELT_RDZV_PORT or 29500 + job id % 1000
#   SMELT_RDZV_ID        the job id (the same after a requeue)
smelt_rendezvous() {
  local nproc=${1:-${SMELT_NPROC:-${SLURM_GPUS_ON_NODE:-}}} hosts=()
  [ -n "${SLURM_JOB_ID:-}" ] || smelt_die "SLURM_JOB_ID is not set: submit this script with sbatch"
  if ! [[ $nproc =~ ^[1-9][0-9]*$ ]]; then
    smelt_die "ranks per node unknown or invalid (${nproc:-unset}): request --gpus-per-node, or set SMELT_NPROC / pass --nproc N"
  fi
  mapfile -t hosts < <(scontrol show hostnames "${SLURM_JOB_NODELIST:-}")
  [ "${#hosts[@]}" -gt 0 ] && [ -n "${hosts[0]}" ] \
    || smelt_die "scontrol show hostnames '${SLURM_JOB_NODELIST:-}' gave no host"
  export SMELT_NNODES=${SLURM_NNODES:-${#hosts[@]}}
  export SMELT_NPROC=$nproc
  export SMELT_RDZV_ENDPOINT="${hosts[0]}:${SMELT_RDZV_PORT:-$((29500 + SLURM_JOB_ID % 1000))}"
  export SMELT_RDZV_ID=$SLURM_JOB_ID
}

# Run one command (srun for train.sbatch, the recipe stage for stage.sbatch) in the background, wait for it and
# exit: with its status, or 0 after requeueing the job, or 143 after a cancellation. Never returns.
#
# SIGUSR1 to this batch shell (#SBATCH --signal=B:USR1@N: the time limit is near, or the cluster preempts with
# SlurmctldParameters=preempt_send_user_signal; or by hand: scancel --signal=USR1 --batch JOBID) is passed on
# with `scancel --signal=USR1 $SLURM_JOB_ID`: every process of every job step (not this batch step) gets USR1,
# on every node. The trainer checkpoints after its current step and exits 0; slurm/task.sh keeps torchrun from
# dying of the USR1 (it ignores it) and hands it to torchrun's workers. When the command has ended, the job
# requeues itself (same job id, same command, resumes from the checkpoint) - at most SMELT_MAX_REQUEUES times.
#
# SIGTERM without a prior SIGUSR1 is a cancellation (scancel JOBID sends SIGCONT+SIGTERM to the batch shell and
# to every step, then SIGKILL after KillWait; a preemption with PreemptMode=REQUEUE/CANCEL does the same and
# Slurm requeues by itself if it should): the job is never requeued from here and exits 143.
smelt_run_step() {
  # slurm/task.sh also touches this node-local file on SIGUSR1, and the trainer checks it before every step:
  # a signal that arrives while the ranks still load (or before torchrun has started them) is not lost.
  export SMELT_STOP_FILE="${TMPDIR:-/tmp}/smelt-stop-${SLURM_JOB_ID}-${SLURM_RESTART_COUNT:-0}"
  _smelt_usr1=0
  _smelt_term=0
  _smelt_signalled=0
  trap '' USR1  # the command starts with SIGUSR1 ignored (a stray USR1 must not kill it; srun resets it)
  "$@" &
  _smelt_child=$!
  trap _smelt_on_usr1 USR1
  trap _smelt_on_term TERM
  local rc
  while :; do
    _smelt_signalled=0
    rc=0
    wait "$_smelt_child" || rc=$?
    # A trapped signal interrupts `wait` (status > 128) while the command still runs: wait again.
    if [ "$_smelt_signalled" = 1 ] && [ "$rc" -gt 128 ] && kill -0 "$_smelt_child" 2>/dev/null; then
      continue
    fi
    if [ "$_smelt_signalled" = 1 ] && [ "$rc" -gt 128 ]; then
      rc=0
      wait "$_smelt_child" || rc=$?  # it ended meanwhile: its own status (bash keeps it)
    fi
    break
  done
  echo "[smelt] $(date '+%F %T') command ended with status $rc"
  if [ "$_smelt_usr1" = 1 ]; then
    local restarts=${SLURM_RESTART_COUNT:-0} max=${SMELT_MAX_REQUEUES:-20}
    if [ "$restarts" -ge "$max" ]; then
      echo "[smelt] not requeued: already restarted $restarts times (SMELT_MAX_REQUEUES=$max); submit again to go on"
      exit 1
    fi
    trap '' TERM USR1  # `scontrol requeue` ends this instance of the job: nothing is left to do here
    echo "[smelt] requeueing job $SLURM_JOB_ID (restart $((restarts + 1))): it resumes from the last checkpoint"
    scontrol requeue "$SLURM_JOB_ID" || { echo "[smelt] scontrol requeue $SLURM_JOB_ID failed" >&2; exit 1; }
    exit 0
  fi
  if [ "$_smelt_term" = 1 ]; then
    echo "[smelt] SIGTERM without a prior SIGUSR1 (scancel or Slurm ending the job): not requeued"
    exit 143
  fi
  exit "$rc"
}

_smelt_on_usr1() {
  _smelt_signalled=1
  _smelt_usr1=1
  echo "[smelt] $(date '+%F %T') SIGUSR1 (time limit near or preemption): every rank checkpoints after its current step"
  scancel --signal=USR1 "$SLURM_JOB_ID" || echo "[smelt] scancel --signal=USR1 $SLURM_JOB_ID failed" >&2
}

_smelt_on_term() {
  _smelt_signalled=1
  _smelt_term=1
  echo "[smelt] $(date '+%F %T') SIGTERM: waiting for the job step to end"
}
