#!/usr/bin/env bash
# The main recipe on its default: the real teacher (SmolLM2-135M-Instruct), a CPU-sized budget.
# Every stage reads the previous stage's artifact and writes its own under $SMELT_RUN.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/env.sh"
cd "$root"
py=.venv/bin/python
run="${SMELT_RUN:-runs/smollm2}"
teacher="${SMELT_TEACHER:-smollm2-135m}"

echo "== teacher: fetch, verify, import"
$py -m models.teacher --teacher "$teacher"
echo "== teacher: evaluation report"
$py -m eval.evaluate --teacher "$teacher" --out "$run/teacher/eval.json"
