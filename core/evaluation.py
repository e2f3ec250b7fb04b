"""How a stage gets its own artifact evaluated: `python -m eval.evaluate` in a child process.

Stages never import each other (they meet through artifacts), so a stage's `--eval` hands the directory
it is writing (still at its temporary path) to the evaluation command, stores the report it returns,
and records it under the artifact's final path. The flags it passes are `EvalConfig.cli_args()`;
tests/test_prune_pipeline.py runs this path end to end.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from core.files import atomic_write_text


def evaluate_dir(tmp_dir: str | Path, final_dir: str | Path, teacher: str, out_json: str | Path,
                 extra: list[str] = ()) -> dict:
    """Run the evaluation CLI on `tmp_dir` against `teacher`; returns its report (also at out_json), in
    which the temporary path is replaced by `final_dir`, where the artifact is about to be renamed."""
    cmd = [sys.executable, "-m", "eval.evaluate", "--model", str(tmp_dir), "--teacher", str(teacher),
           "--out", str(out_json), *extra]
    proc = subprocess.run(cmd, stdout=sys.stderr, check=False)  # its table and progress show as they come
    if proc.returncode:
        raise SystemExit(proc.returncode)  # its one-line error is already on stderr; the caller cleans up
    text = Path(out_json).read_text().replace(str(tmp_dir), str(final_dir))
    atomic_write_text(out_json, text)
    return json.loads(text)
