#!/bin/bash
# Submit one Slurm job from the login node: sbatch's own command line, run from the repository root, after
#   - checking .venv (built once here with scripts/env.sh: a job never installs anything), and
#   - creating the log directory: Slurm opens a job's --output file before its script runs, so the directory
#     must exist at submission (logs/, or SMELT_LOG_DIR; each job writes %x-%j.out there, appended on requeue).
#
#   slurm/submit.sh [SBATCH_OPTION...] slurm/train.sbatch [TRAIN_ARG...]
#   slurm/submit.sh --nodes=2 --time=08:00:00 slurm/train.sbatch --config h100_recover --student ...
#
# Prints sbatch's answer (`Submitted batch job N`; with --parsable just N).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=slurm/lib.sh
source "$root/slurm/lib.sh"
case "${1:-}" in
  ""|-h|--help) echo "usage: slurm/submit.sh [SBATCH_OPTION...] SCRIPT [ARG...]  (from the repository root)"; exit 0 ;;
esac
cd "$root"
smelt_check_venv "$root"
log_dir=${SMELT_LOG_DIR:-$root/logs}
mkdir -p "$log_dir"
exec sbatch --output="$log_dir/%x-%j.out" "$@"
