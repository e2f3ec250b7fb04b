#!/usr/bin/env bash
# Recovery levers side by side (issue 16): each lever distils the same 2:4 start with the recipe's
# recovery budget, then is evaluated against the teacher. Levers are arguments:
#   fixed   masks frozen at the pruner's choice (the recipe's recovery)
#   srste   masks re-selected by latent magnitude until 75% of the steps (train.masks)
#   hidden  + layer-wise normalised MSE on blocks 5,11,17,23,29 (weight 1)
#   hidden-dense  + layer-wise normalised MSE on every third block from 2 (weight 5)
#   fixed-seed1   fixed masks on another shuffle of the same text (the run-to-run spread)
# Env: START (the 2:4 artifact, default runs/smollm2/pruned-2of4), RUNS (default runs/levers),
#      OUT (default results/bench/recovery-levers), STEPS (default 60), DTYPE (default bfloat16).
#   scripts/bench_recovery_levers.sh fixed srste hidden
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
START="${START:-runs/smollm2/pruned-2of4}" RUNS="${RUNS:-runs/levers}" OUT="${OUT:-results/bench/recovery-levers}"
STEPS="${STEPS:-60}" DTYPE="${DTYPE:-bfloat16}"
mkdir -p "$RUNS" "$OUT"
for lever in "$@"; do
  case "$lever" in
    fixed) extra=() ;;
    srste) extra=(--mask_learning.mode srste) ;;
    hidden) extra=(--loss.hidden_weight 1.0 --loss.hidden_layers "5,11,17,23,29") ;;
    fixed-seed1) extra=(--dataloader.seed 1) ;;
    hidden-dense) extra=(--loss.hidden_weight 5.0 --loss.hidden_layers "2,5,8,11,14,17,20,23,26,29") ;;
    *) echo "error: lever $lever is not one of fixed, srste, hidden, hidden-dense, fixed-seed1" >&2; exit 2 ;;
  esac
  art="$RUNS/$lever"
  start=$(date +%s)
  .venv/bin/python -m train.launch --nproc 2 -- --module train.config_registry --config smollm2_recover \
    --student "$START" --teacher smollm2-135m --dump_folder "$art-run" --export_dir "$art" \
    --training.steps "$STEPS" --training.mixed_precision_param "$DTYPE" "${extra[@]}"
  train_s=$(( $(date +%s) - start ))
  .venv/bin/python -m eval.evaluate --teacher smollm2-135m --model "$art" --out "$OUT/$lever.json"
  .venv/bin/python - "$OUT/$lever.json" "$art/manifest.json" "$train_s" "$lever" "${extra[*]:-}" <<'PY'
import json, sys
out, manifest, train_s, lever, extra = sys.argv[1:]
report, m = json.load(open(out)), json.load(open(manifest))
report["lever"] = {"name": lever, "overrides": extra, "train_wall_s": int(train_s),
                   "tokens": m["settings"]["tokens_seen"] * m["settings"]["dp_shard"],  # tokens_seen is per rank
                   "mask_learning": m["settings"].get("mask_learning")}
json.dump(report, open(out, "w"), indent=1)
PY
  rm -rf "$art-run"  # checkpoints: GBs, not results
done
