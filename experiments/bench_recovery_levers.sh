#!/usr/bin/env bash
# Recovery levers side by side: each lever distils the same 2:4 start with the recipe's
# recovery budget, then is evaluated against the teacher. Levers are arguments:
#   fixed   masks frozen at the pruner's choice (the recipe's recovery)
#   srste   masks re-selected by latent magnitude until 75% of the steps (train.masks)
#   maskllm masks learned as per-group distributions over the six 2:4 candidates (Gumbel-softmax, prior on
#           the pruner's choice, pruned latents from the teacher) until 75% of the steps (train.masks)
#   maskllm-priorP  the same with the pruner's candidate at logit P (maskllm-prior8: sampled masks start
#           nearly deterministic, another candidate drawn for ~0.2% of the groups a step, not ~20%)
#   lrX     fixed masks at peak learning rate X (lr3e-4; the recipe's recovery uses 1e-4)
#   hidden  + layer-wise normalised MSE on blocks 5,11,17,23,29 (weight 1)
#   hidden-dense  + layer-wise normalised MSE on every third block from 2 (weight 5)
#   fixed-seed1   fixed masks on another shuffle of the same text (the run-to-run spread)
#   onpolicy      fixed masks, a quarter of the steps on the student's own continuations of the data's
#                 first 32 tokens, scored by the teacher (train.on_policy)
#   topkK   fixed masks, the teacher read from a top-K cache (distill.teacher_cache, built once into
#           $RUNS/cache-topK with the teacher in DTYPE; its build time goes into the lever's JSON)
# Env: START (the 2:4 artifact, default runs/smollm2/pruned-2of4), RUNS (default runs/levers),
#      OUT (default results/bench/recovery-levers), STEPS (default 60), DTYPE (default bfloat16).
#   experiments/bench_recovery_levers.sh fixed srste hidden
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
START="${START:-runs/smollm2/pruned-2of4}" RUNS="${RUNS:-runs/levers}" OUT="${OUT:-results/bench/recovery-levers}"
STEPS="${STEPS:-60}" DTYPE="${DTYPE:-bfloat16}"
number() {  # number LEVER VALUE WHAT: a one-line error unless VALUE is a plain or e-notation number
  [[ $2 =~ ^[0-9]+(\.[0-9]+)?(e-?[0-9]+)?$ ]] || { echo "error: lever $1: $3 must be a number" >&2; exit 2; }
}
lever_args() {  # lever_args LEVER: its trainer overrides into `extra`, a topk lever's cache path into `cache`
  case "$1" in
    fixed) extra=() ;;
    srste) extra=(--mask_learning.mode srste) ;;
    maskllm) extra=(--mask_learning.mode maskllm) ;;
    maskllm-prior[0-9]*)
      number "$1" "${1#maskllm-prior}" "the prior"
      extra=(--mask_learning.mode maskllm --mask_learning.prior "${1#maskllm-prior}") ;;
    lr[0-9]*)
      number "$1" "${1#lr}" "the learning rate"
      extra=(--optimizer.param-groups.0.optimizer-kwargs.lr "${1#lr}") ;;
    hidden) extra=(--loss.hidden_weight 1.0 --loss.hidden_layers "5,11,17,23,29") ;;
    fixed-seed1) extra=(--dataloader.seed 1) ;;
    onpolicy) extra=(--on_policy.share 0.25 --on_policy.prompt_tokens 32) ;;
    hidden-dense) extra=(--loss.hidden_weight 5.0 --loss.hidden_layers "2,5,8,11,14,17,20,23,26,29") ;;
    topk[0-9]*)
      [[ ${1#topk} =~ ^[0-9]+$ ]] || { echo "error: lever $1: K must be a whole number" >&2; exit 2; }
      cache="$RUNS/cache-$1"
      extra=(--dataloader.teacher_cache "$cache") ;;
    *) echo "error: lever $1 is not one of fixed, srste, maskllm, maskllm-priorP, lrX, hidden, hidden-dense, fixed-seed1, onpolicy, topkK" >&2; exit 2 ;;
  esac
}
for lever in "$@"; do lever_args "$lever"; done  # every lever checked before the first one trains
mkdir -p "$RUNS" "$OUT"
for lever in "$@"; do
  lever_args "$lever"
  build_s=0
  if [[ $lever == topk* && ! -d $cache ]]; then  # the recipe's recovery layout: 2 ranks x 2 windows of 256, its mix, seed 0
    start=$(date +%s)
    .venv/bin/python -m distill.teacher_cache --teacher smollm2-135m --source wikitext2-valid+code-train+zh-train \
      --seq-len 256 --windows $((STEPS * 4)) --top-k "${lever#topk}" --ranks 2 --local-batch 2 \
      --dtype "$DTYPE" --out "$cache"
    build_s=$(( $(date +%s) - start ))
  fi
  art="$RUNS/$lever"
  start=$(date +%s)
  .venv/bin/python -m train.launch --nproc 2 -- --module train.config_registry --config smollm2_recover \
    --student "$START" --teacher smollm2-135m --dump_folder "$art-run" --export_dir "$art" \
    --training.steps "$STEPS" --training.mixed_precision_param "$DTYPE" "${extra[@]}"
  train_s=$(( $(date +%s) - start ))
  # news: the held-out English bucket (nothing trains on it), for the generalisation check
  .venv/bin/python -m eval.evaluate --teacher smollm2-135m --model "$art" --windows en=16,zh=8,code=8,news=16 \
    --out "$OUT/$lever.json"
  .venv/bin/python - "$OUT/$lever.json" "$art/manifest.json" "$train_s" "$lever" "${extra[*]:-}" "$build_s" <<'PY'
import json, sys
out, manifest, train_s, lever, extra, build_s = sys.argv[1:]
report, m = json.load(open(out)), json.load(open(manifest))
report["lever"] = {"name": lever, "overrides": extra, "train_wall_s": int(train_s), "cache_build_s": int(build_s),
                   "tokens": m["settings"]["tokens_seen"] * m["settings"]["dp_shard"],  # tokens_seen is per rank
                   "mask_learning": m["settings"].get("mask_learning")}
json.dump(report, open(out, "w"), indent=1)
PY
  rm -rf "$art-run"  # checkpoints: GBs, not results
done
