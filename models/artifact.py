"""The artifact format every stage writes: a directory of safetensors files plus `manifest.json`.

Writes go to a hidden temporary sibling directory that is renamed into place only on success, so an
interrupted stage leaves no half-written artifact; an existing directory is replaced only when the
caller asks (and only after the new one is complete).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from pathlib import Path

from models.errors import SmeltError


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def atomic_dir(path: str | Path, overwrite: bool = False):
    """Yield a temporary directory; on normal exit it becomes `path` (atomically renamed)."""
    path = Path(path)
    if path.exists() and not overwrite:
        raise SmeltError(f"output directory {path} already exists (pass --overwrite to replace it)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if path.exists():
        old = path.parent / f".{path.name}.old-{os.getpid()}"
        os.rename(path, old)
    os.rename(tmp, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def atomic_write_text(path: str | Path, text: str) -> None:
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_manifest(out_dir: str | Path, stage: str, settings: dict, metrics: dict | None = None,
                   parent: dict | None = None) -> dict:
    """manifest.json: what made this artifact, from what, with which settings, and file hashes."""
    out_dir = Path(out_dir)
    files = {p.name: sha256_file(p) for p in sorted(out_dir.iterdir())
             if p.is_file() and p.name != "manifest.json"}
    manifest = {
        "format": "smelt-artifact/1",
        "stage": stage,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "settings": settings,
        "metrics": metrics or {},
        "parent": parent,
        "files": files,
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
    return manifest


def read_manifest(art_dir: str | Path) -> dict:
    p = Path(art_dir) / "manifest.json"
    if not p.is_file():
        raise SmeltError(f"{art_dir} has no manifest.json (not a smelt artifact)")
    return json.loads(p.read_text())


def parent_record(src_dir: str | Path) -> dict | None:
    """How a manifest points at the artifact it was made from: path, stage and settings."""
    src_dir = Path(src_dir)
    if not (src_dir / "manifest.json").is_file():
        return {"path": str(src_dir)}
    m = read_manifest(src_dir)
    return {"path": str(src_dir), "stage": m["stage"], "settings": m["settings"]}
