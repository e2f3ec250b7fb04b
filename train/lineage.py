"""Which teacher block each student block came from, read from the student's manifest chain.

Depth removal (prune.depth) drops blocks and save_hf renumbers the rest 0..n-1, recording the removed
indices in its manifest (`metrics.removed_layers`, in its input's numbering). Walking the `parent`
paths from the student up and undoing each removal maps student block i to the teacher block it is.
Layer-wise distillation needs that map to pair blocks. No torchtitan import: train.launch's checks use it.
"""
from __future__ import annotations

from pathlib import Path

from core.artifact import read_manifest
from core.errors import SmeltError


def teacher_blocks(student_dir: str | Path, n_student: int, n_teacher: int) -> list[int]:
    """[teacher block index of student block i for i in range(n_student)]."""
    idx, n, d, seen = list(range(n_student)), n_student, Path(student_dir), set()
    while d is not None and (d / "manifest.json").is_file() and d.resolve() not in seen:
        seen.add(d.resolve())
        m = read_manifest(d)
        if m["stage"] == "depth":  # undo it: its input had n + len(removed) blocks
            removed = set(m.get("metrics", {}).get("removed_layers", []))
            kept = [i for i in range(n + len(removed)) if i not in removed]
            idx, n = [kept[i] for i in idx], n + len(removed)
        parent = (m.get("parent") or {}).get("path")
        d = Path(parent) if parent else None
    if n != n_teacher:
        raise SmeltError(f"--student {student_dir}: {n_student} blocks against the teacher's {n_teacher}, and "
                         f"its manifest chain does not say which blocks depth removal kept")
    return idx
