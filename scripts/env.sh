#!/usr/bin/env bash
# Create or refresh the project's virtual environment (.venv). Idempotent: a stamp of pyproject.toml
# skips the install when nothing changed. torch is pinned through a constraints file so that no
# dependency's install step can replace it. `--check`: only say whether .venv is current (exit 2 if not).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${SMELT_VENV:-$root/.venv}"
stamp="$venv/.smelt-stamp"
want="$(cat "$root/pyproject.toml" "$root/scripts/constraints.txt" | sha256sum | cut -d' ' -f1)"
if [ "${1:-}" = "--check" ]; then  # jobs on compute nodes: check, never install (slurm/lib.sh)
  if [ ! -x "$venv/bin/python" ]; then
    echo "error: $venv does not exist: run scripts/env.sh on the login node (never inside a job), then submit again" >&2
    exit 2
  fi
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "error: $venv is out of date (pyproject.toml or scripts/constraints.txt changed since it was built): run scripts/env.sh on the login node, then submit again" >&2
    exit 2
  fi
  exit 0
fi
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[smelt] installing dependencies into $venv" >&2
  "$venv/bin/pip" install -q --upgrade pip >&2
  "$venv/bin/pip" install -q -c "$root/scripts/constraints.txt" "torch==2.14.1" >&2
  "$venv/bin/pip" install -q -c "$root/scripts/constraints.txt" -e "$root[dev]" >&2
  echo "$want" > "$stamp"
fi
