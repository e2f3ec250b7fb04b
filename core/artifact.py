"""The artifact every stage writes: an HF directory (core.files.atomic_dir) plus `manifest.json`, which
records what made it, from what (`parent`), with which settings, and the sha256 of every file.
"""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from core.errors import SmeltError
from core.files import atomic_write_text, read_json, sha256_file


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
    atomic_write_text(out_dir / "manifest.json", json.dumps(manifest, indent=2, sort_keys=False) + "\n")
    return manifest


def read_manifest(art_dir: str | Path) -> dict:
    p = Path(art_dir) / "manifest.json"
    manifest = read_json(p, "a smelt artifact")
    if not isinstance(manifest, dict) or "stage" not in manifest:
        raise SmeltError(f"{p} has no 'stage' (not a smelt manifest)")
    return manifest


def training_step(model_dir: str | Path) -> int:
    """The training step that made an artifact (its manifest's settings.steps); 0 for a model no training
    stage wrote (a teacher, a pruned or quantized artifact)."""
    if not (Path(model_dir) / "manifest.json").is_file():
        return 0
    steps = read_manifest(model_dir).get("settings", {}).get("steps")
    return steps if isinstance(steps, int) and not isinstance(steps, bool) and steps >= 0 else 0


def parent_record(src_dir: str | Path) -> dict | None:
    """How a manifest points at the artifact it was made from: path, stage and settings."""
    src_dir = Path(src_dir)
    if not (src_dir / "manifest.json").is_file():
        return {"path": str(src_dir)}
    m = read_manifest(src_dir)
    return {"path": str(src_dir), "stage": m["stage"], "settings": m.get("settings")}


def weights_fingerprint(model_dir: str | Path) -> str:
    """Hash of config.json and the safetensors files of an HF directory (cache keys, parent records)."""
    model_dir = Path(model_dir)
    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    for f in sorted(model_dir.glob("*.safetensors")):
        h.update(sha256_file(f).encode())
    return h.hexdigest()
