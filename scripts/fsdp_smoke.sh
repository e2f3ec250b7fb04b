#!/usr/bin/env bash
# FSDP2 over NPROC ranks on SmolLM2 (scripts/gpu_smoke.sh runs it over every GPU of a node that has 2 or more):
# recover, MTP and QAT a few steps each, each ending in its export; the recovery a second time, killed (-9)
# after its first checkpoint and rerun, against the uninterrupted one (deterministic kernels: the same
# weights); the QAT artifact released and verified. Prints one line per check.
#
#   scripts/fsdp_smoke.sh NPROC PRUNED_ARTIFACT OUT_DIR
#
# SMELT_SMOKE_DTYPE (default bfloat16) is the compute dtype; float32 runs it on CPU ranks (gloo) as well.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
[ $# -eq 3 ] || { echo "usage: scripts/fsdp_smoke.sh NPROC PRUNED_ARTIFACT OUT_DIR" >&2; exit 2; }
py=.venv/bin/python
n=$1
pruned=$2
out=$3
dtype=${SMELT_SMOKE_DTYPE:-bfloat16}
run="$(mktemp -d)"
trap 'rm -rf "$run"' EXIT
mkdir -p "$out"

train() {  # CONFIG STUDENT NAME STEPS: NAME's dump folder and NAME-out export under $run, its log under $out
  local config=$1 student=$2 name=$3 steps=$4
  "$py" -m train.launch --nproc "$n" -- --module train.config_registry --config "$config" \
    --student "$student" --teacher smollm2-135m --dump_folder "$run/$name" --export_dir "$run/$name-out" \
    --training.mixed_precision_param "$dtype" --training.seq_len 256 --training.local_batch_size 2 \
    --training.global_batch_size $((2 * n)) --checkpoint.interval 2 --debug.deterministic \
    --training.steps "$steps" >>"$out/fsdp-$name.log" 2>&1
}

train smollm2_recover "$pruned" recover 4
echo "fsdp recover: $n ranks, 4 steps, exported: $(test -f "$run/recover-out/model.safetensors" && echo yes || echo NO)"

train smollm2_recover "$pruned" killed 4 &  # the same run, killed after its step-2 checkpoint
pid=$!
until [ -f "$run/killed/checkpoint/step-2/.metadata" ] || ! kill -0 "$pid" 2>/dev/null; do sleep 1; done
pkill -9 -f -- "--dump_folder $run/killed " || true  # the launcher, torchrun and every rank (each its own session)
wait "$pid" 2>/dev/null || true
train smollm2_recover "$pruned" killed 4
grep -q "Loading the checkpoint" "$out/fsdp-killed.log" && echo "fsdp resume: loaded the step-2 checkpoint"
"$py" -m eval.compare_weights "$run/recover-out" "$run/killed-out" --out "$out/fsdp-resume-compare.json" \
  | tail -n 1 | sed 's/^/fsdp resume vs uninterrupted: /'

train smollm2_mtp "$run/recover-out" mtp 4
echo "fsdp mtp: exported $(test -f "$run/mtp-out/mtp.safetensors" && echo mtp.safetensors || echo NOTHING)"

"$py" -m qat.ptq --artifact "$run/recover-out" --method rtn --group-size 64 --out "$run/rtn" >"$out/fsdp-ptq.log" 2>&1
train smollm2_qat "$run/rtn" qat 4
"$py" -m qat.release --artifact "$run/qat-out" --out "$run/release" >"$out/fsdp-release.log" 2>&1
"$py" -m qat.verify "$run/release" >"$out/fsdp-verify.log" 2>&1 && echo "fsdp qat: released and verified"
