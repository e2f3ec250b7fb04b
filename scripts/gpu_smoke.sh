#!/usr/bin/env bash
# The GPU path in a few minutes. One GPU: NCCL process group, SmolLM2 recovery in bf16 (fp32 masters and
# reductions), a checkpoint, a resume, tokens/s and peak memory; then a 2:4 + W4 release run through the
# Triton kernels in bf16 (kernels.check) and the kernels' speed (kernels.bench). On a node with 2 or more GPUs,
# then FSDP over all of them (scripts/fsdp_smoke.sh): recover, MTP and QAT a few steps each with the export,
# a run killed after a checkpoint and resumed against an uninterrupted one, the QAT release verified. Never
# needed by the tests.
#
#   scripts/gpu_smoke.sh [OUT_DIR]     # default results/bench/gpu-smoke; commit OUT_DIR/summary.txt with the GPU named
#
# Needs the environment (scripts/env.sh) and the teacher in the cache (python -m models.teacher), both done
# beforehand on a machine with network access: a compute node may have none.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py=.venv/bin/python
out="${1:-results/bench/gpu-smoke}"
mkdir -p "$out"
run="$(mktemp -d)"
trap 'rm -rf "$run"' EXIT
export WANDB_MODE="${WANDB_MODE:-offline}"
gpu="$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -n 1)"
echo "gpu: $gpu" | tee "$out/summary.txt"

echo "== a 2:4 student (magnitude: seconds) to recover"
$py -m prune.run --teacher smollm2-135m --method magnitude --pattern 2:4 --out "$run/pruned" >"$out/prune.log" 2>&1

stage() {  # steps, log: the same command twice is a resume
  $py -m train.launch --nproc 1 -- --module train.config_registry --config smollm2_recover \
    --student "$run/pruned" --teacher smollm2-135m --dump_folder "$run/recover" --export_dir "$run/recovered" \
    --training.mixed_precision_param bfloat16 --training.seq_len 1024 --training.local_batch_size 8 \
    --training.global_batch_size 8 --checkpoint.interval 10 --training.steps "$1" 2>&1 | tee "$2"
}
echo "== recover: 10 steps (checkpoint at 10), then resume to 20"
stage 10 "$out/part1.log"
stage 20 "$out/part2.log"
{
  grep -q "Loading the checkpoint" "$out/part2.log" && echo "resume: loaded the step-10 checkpoint"
  [ -f "$run/recovered/model.safetensors" ] && echo "export: written after step 20"
  grep -h "loaded: peak RSS" "$out/part1.log" | tail -n 1
  grep -h "step: 20" "$out/part2.log" | tail -n 1
} | tee -a "$out/summary.txt"

echo "== kernels: a 2:4 + W4 release (RTN on the 2:4 student) through the Triton kernels in bf16, then their speed"
$py -m qat.ptq --artifact "$run/pruned" --method rtn --group-size 64 --out "$run/rtn" >"$out/ptq.log" 2>&1
$py -m qat.release --artifact "$run/rtn" --out "$run/release" --sparse-storage compressed >"$out/release.log" 2>&1
$py -m kernels.check "$run/release" --dtype bfloat16 --device cuda --out "$out/kernels-check.json" | tee -a "$out/summary.txt"
$py -m kernels.bench --out "$out/kernels-bench.json" | tee "$out/kernels-bench.txt"

echo "== one-shot stages on the GPU: SparseGPT 2:4 and GPTQ W4 g64 on 128 x 512 windows (CPU: README's time table)"
for fwd in float32 bfloat16; do
  $py -m prune.bench --method sparsegpt --pattern 2:4 --calib-forward "$fwd" --calib-hessian float32 \
    --json "$out/sparsegpt-$fwd.json" | tee -a "$out/summary.txt"
  $py -m qat.ptq --method gptq --group-size 64 --act-order --calib-forward "$fwd" --calib-hessian float32 \
    --out "$run/gptq-$fwd" | tee -a "$out/summary.txt"  # prints its time; the manifest has the peak RSS and GPU memory
  cp "$run/gptq-$fwd/manifest.json" "$out/gptq-$fwd.manifest.json"
done
# true-sequential with bf16 XᵀX products summed in fp64: the fastest setting at equal quality on the CPU (README)
$py -m prune.bench --method sparsegpt --pattern 2:4 --calib-forward bfloat16 --calib-hessian bfloat16 \
  --calib-true-sequential --json "$out/sparsegpt-bfloat16-ts.json" | tee -a "$out/summary.txt"
$py -m qat.ptq --method gptq --group-size 64 --act-order --calib-forward bfloat16 --calib-hessian bfloat16 \
  --calib-true-sequential --out "$run/gptq-bfloat16-ts" | tee -a "$out/summary.txt"
cp "$run/gptq-bfloat16-ts/manifest.json" "$out/gptq-bfloat16-ts.manifest.json"

gpus="$(nvidia-smi -L | wc -l)"
if [ "$gpus" -ge 2 ]; then
  echo "== FSDP over $gpus GPUs"
  bash scripts/fsdp_smoke.sh "$gpus" "$run/pruned" "$out" | tee -a "$out/summary.txt"
fi
