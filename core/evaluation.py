"""How a stage gets its own artifact evaluated: `python -m eval.evaluate` in a child process.

Stages never import each other (they meet through artifacts), so a stage's `--eval` hands the directory
it just wrote (still its temporary path) to the evaluation command and stores the JSON it returns.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from core.errors import SmeltError


def evaluate_dir(model_dir: str | Path, teacher: str, out_json: str | Path, extra: list[str] = ()) -> dict:
    """Run the evaluation CLI on `model_dir` against `teacher`; returns its report (also at out_json)."""
    cmd = [sys.executable, "-m", "eval.evaluate", "--model", str(model_dir), "--teacher", str(teacher),
           "--out", str(out_json), *extra]
    proc = subprocess.run(cmd, stdout=sys.stderr, check=False)  # its table and progress show as they come
    if proc.returncode:
        raise SmeltError(f"evaluation of {model_dir} failed (exit {proc.returncode}; its error is above)")
    return json.loads(Path(out_json).read_text())
