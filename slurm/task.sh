#!/bin/bash
# One node's task of a training job step: srun runs it once per node, in front of train.launch.
#
#   srun --ntasks-per-node=1 --kill-on-bad-exit=1 slurm/task.sh .venv/bin/python -m train.launch ...
#
# Why: the checkpoint signal is SIGUSR1 (see slurm/lib.sh). Slurm delivers a step's signals to the processes
# of the step through its proctrack plugin: with proctrack/cgroup every process (torchrun and its workers),
# with proctrack/pgid only the task's process group, which torchrun's workers are not in (torch.distributed
# .elastic starts each worker with start_new_session=True). torchrun handles only SIGTERM, SIGINT, SIGHUP
# and SIGQUIT (TORCHELASTIC_SIGNALS_TO_HANDLE); SIGUSR1's default action would kill it and orphan the
# workers. So:
#   - the command (train.launch, which execs torchrun on the same pid) starts with SIGUSR1 ignored, which an
#     exec keeps; the trainer installs its own SIGUSR1 handler in every worker;
#   - this wrapper hands each SIGUSR1 it gets to torchrun's children, the workers (a second copy under
#     proctrack/cgroup is harmless: the trainer only sets a flag, and all ranks agree on the stop step);
#   - SIGTERM/SIGINT/SIGHUP are not passed on (torchrun gets them from Slurm directly; a second SIGTERM would
#     cut torchrun's shutdown short), but this wrapper keeps waiting, so that the task ends only when torchrun
#     has ended: slurmstepd kills what is left of a step once its tasks have exited.
set -uo pipefail
[ $# -gt 0 ] || { echo "error: usage: slurm/task.sh COMMAND [ARG...]" >&2; exit 2; }

# A stop file left by an earlier run with this job id and restart count (job ids wrap) must not stop this one.
[ -z "${SMELT_STOP_FILE:-}" ] || rm -f "$SMELT_STOP_FILE"
trap '' USR1
"$@" &
child=$!
forward_usr1() {
  signalled=1
  [ -z "${SMELT_STOP_FILE:-}" ] || touch "$SMELT_STOP_FILE"  # read by the trainer before each step
  pkill -USR1 -P "$child" 2>/dev/null || true
}
trap forward_usr1 USR1
trap 'signalled=1' TERM INT HUP

while :; do
  signalled=0
  rc=0
  wait "$child" || rc=$?
  if [ "$signalled" = 1 ] && [ "$rc" -gt 128 ]; then
    kill -0 "$child" 2>/dev/null && continue
    rc=0
    wait "$child" || rc=$?
  fi
  exit "$rc"
done
