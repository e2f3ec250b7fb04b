#!/usr/bin/env bash
# Create or refresh the project's virtual environment (.venv). Idempotent: a stamp of pyproject.toml
# skips the install when nothing changed. torch is pinned through a constraints file so that no
# dependency's install step can replace it.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${SMELT_VENV:-$root/.venv}"
stamp="$venv/.smelt-stamp"
want="$(cat "$root/pyproject.toml" "$root/scripts/constraints.txt" | sha256sum | cut -d' ' -f1)"
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
