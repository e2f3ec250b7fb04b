#!/bin/bash
# Submit a recipe from the login node as a chain of Slurm jobs: one slurm/stage.sbatch job per stage, each
# starting only once the previous one has succeeded (--dependency=afterok, --kill-on-invalid-dep=yes: when a
# stage fails, the rest of the chain is cancelled instead of waiting forever). A stage that requeues itself
# (time limit, preemption) keeps its job id, so the chain waits for it.
#
#   slurm/chain.sh [--after JOBID] [--set KEY=VALUE...] [SBATCH_OPTION=VALUE...] RECIPE [STAGE...]
#
#   r=configs/recipes/llama3.1-8b-h100.toml
#   slurm/chain.sh --nodes=2 --time=08:00:00 $r                  # every stage it lists
#   slurm/chain.sh --nodes=1 $r teacher prune                    # some stages, in the order given
#   slurm/chain.sh --after 1234 --nodes=2 $r recover quantize    # the rest, after job 1234
#
# Stages: the arguments after RECIPE, else the lines of `python -m configs.recipe RECIPE --list-stages`.
# Each job runs `python -m configs.recipe RECIPE --stage NAME` (slurm/stage.sbatch) from the repository root
# (a RECIPE file is passed as an absolute path); it is named smelt-<recipe file's base name>-NAME and logs to
# logs/<job name>-JOBID.out (SMELT_LOG_DIR to change the directory). --set KEY=VALUE goes to every
# `configs.recipe` call (the listing and each stage), e.g. --set run_dir=/scratch/me/run1.
# SBATCH options go to every job of the chain and must be written --option=value. Prints one line per job.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=slurm/lib.sh
source "$root/slurm/lib.sh"
usage="usage: slurm/chain.sh [--after JOBID] [--set KEY=VALUE...] [SBATCH_OPTION=VALUE...] RECIPE [STAGE...]"

after=""
sets=()
sbatch_opts=()
while [ $# -gt 0 ]; do
  case $1 in
    -h|--help) echo "$usage"; exit 0 ;;
    --after) [ $# -ge 2 ] || smelt_die "--after needs a job id"; after=$2; shift 2 ;;
    --after=*) after=${1#--after=}; shift ;;
    --set) [ $# -ge 2 ] || smelt_die "--set needs KEY=VALUE"; sets+=(--set "$2"); shift 2 ;;
    --set=*) sets+=(--set "${1#--set=}"); shift ;;
    --) shift; break ;;
    -*) sbatch_opts+=("$1"); shift ;;
    *) break ;;
  esac
done
[ $# -ge 1 ] || smelt_die "$usage"
[ -z "$after" ] || [[ $after =~ ^[0-9]+$ ]] || smelt_die "--after $after: not a job id"
recipe=$1
shift
# A recipe file named relative to here still works from the root; jobs are named after its base name.
if [ -e "$recipe" ]; then
  recipe="$(cd "$(dirname "$recipe")" && pwd)/$(basename "$recipe")"
fi
name=$(basename "$recipe")
name=${name%.toml}
name=${name//[^A-Za-z0-9_.-]/-}
cd "$root"
smelt_check_venv "$root"

if [ $# -gt 0 ]; then
  stages=("$@")
else
  listing=$("$SMELT_PYTHON" -m configs.recipe "$recipe" "${sets[@]}" --list-stages) \
    || smelt_die "python -m configs.recipe $recipe --list-stages failed"
  stages=()
  while IFS= read -r line; do
    [ -n "$line" ] && stages+=("$line")
  done <<<"$listing"
fi
[ "${#stages[@]}" -gt 0 ] || smelt_die "recipe $recipe has no stages"
# Only training stages run on every node; the others (pruning, PTQ, evaluation, release) run in the batch shell
# of the first node, so they are submitted on one node (after the options given here, which they override).
training=$("$SMELT_PYTHON" -m configs.recipe "$recipe" "${sets[@]}" --training-stages) \
  || smelt_die "python -m configs.recipe $recipe --training-stages failed"
for stage in "${stages[@]}"; do
  [[ $stage =~ ^[A-Za-z0-9_.-]+$ ]] || smelt_die "stage name '$stage': only letters, digits, '_', '.', '-'"
done

log_dir=${SMELT_LOG_DIR:-$root/logs}
mkdir -p "$log_dir"
prev=$after
for stage in "${stages[@]}"; do
  dep=()
  [ -z "$prev" ] || dep=(--dependency="afterok:$prev" --kill-on-invalid-dep=yes)
  one=()
  grep -qxF -- "$stage" <<<"$training" || one=(--nodes=1)
  out=$(sbatch --parsable --job-name="smelt-$name-$stage" --output="$log_dir/%x-%j.out" "${dep[@]}" \
    "${sbatch_opts[@]}" "${one[@]}" slurm/stage.sbatch "$recipe" "$stage" "${sets[@]}") \
    || smelt_die "sbatch failed for stage $stage"
  id=${out%%;*}  # --parsable: JOBID[;CLUSTER]
  [[ $id =~ ^[0-9]+$ ]] || smelt_die "sbatch answered '$out' for stage $stage, not a job id"
  echo "$stage: job $id${prev:+ (after $prev)}"
  prev=$id
done
