#!/usr/bin/env bash
# The main recipe on its default: the real teacher (SmolLM2-135M-Instruct), a CPU-sized budget.
#
#   teacher -> SparseGPT 2:4 -> MLP reconstruction -> KD recovery -> GPTQ W4 g64 (2:4 kept)
#     -> quantized MLP reconstruction -> QAT + KD -> release -> verify
#
# The chain is configs/recipes/smollm2-cpu.toml, run by `python -m configs.recipe` (its --dry-run prints
# the plan: stages, commands, tokens, memory per rank). Every stage reads the previous stage's artifact
# and writes its own under $SMELT_RUN, then is evaluated against the teacher (per-token KL mean/P99,
# top-1, PPL per bucket); a finished stage is skipped on a rerun. wandb logs offline under the run
# (WANDB_MODE=online to sync). Budgets are env vars, or pass --set KEY=VALUE arguments through (unset: the
# recipe file's values): SMELT_RECOVER_STEPS, SMELT_QAT_STEPS, SMELT_CALIB_WINDOWS (prune and GPTQ),
#   SMELT_NPROC (training processes), SMELT_RUN (default runs/smollm2), SMELT_TEACHER.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/env.sh"
cd "$root"
sets=()
[ -n "${SMELT_RUN:-}" ] && sets+=(--set "run_dir=$SMELT_RUN")
[ -n "${SMELT_TEACHER:-}" ] && sets+=(--set "teacher=$SMELT_TEACHER")
[ -n "${SMELT_RECOVER_STEPS:-}" ] && sets+=(--set "stages.recover.steps=$SMELT_RECOVER_STEPS")
[ -n "${SMELT_QAT_STEPS:-}" ] && sets+=(--set "stages.qat.steps=$SMELT_QAT_STEPS")
if [ -n "${SMELT_CALIB_WINDOWS:-}" ]; then
  sets+=(--set "stages.prune.calib_windows=$SMELT_CALIB_WINDOWS" --set "stages.quantize.calib_windows=$SMELT_CALIB_WINDOWS")
fi
exec .venv/bin/python -m configs.recipe configs/recipes/smollm2-cpu.toml "${sets[@]}" "$@"
