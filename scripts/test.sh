#!/usr/bin/env bash
# Run the test suite (creates/refreshes .venv first). Extra arguments go to pytest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/env.sh"
cd "$root"
exec .venv/bin/python -m pytest "$@"
