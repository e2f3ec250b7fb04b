"""Files on disk: hashes, atomic writes (temp path, then rename) and checked safetensors reads.

Every writer in the project goes through here, so an interrupted stage never leaves a half-written file
or directory where a finished one is expected, every file written has the mode the user's umask gives a new
file, and every reader turns a truncated or corrupt file, or a
non-finite weight, into one line that names the file and the tensor. Only safetensors are read.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import struct
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from core.errors import SmeltError


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _tmp_sibling(path: Path, tag: str = "tmp") -> Path:
    return path.parent / f".{path.name}.{tag}-{os.getpid()}"


def new_file_mode() -> int:
    """The mode open() gives a new file under this process's umask (0o644 under umask 022)."""
    try:  # Linux reports it without changing it
        status = Path("/proc/self/status").read_text()
        umask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("Umask:")), 8)
    except (OSError, StopIteration, ValueError, IndexError):
        umask = os.umask(0)
        os.umask(umask)
    return 0o666 & ~umask


def canonical_safetensors(path: Path) -> None:
    """Sort a safetensors header's metadata keys, in place: the writer keeps them in a hash map whose order
    changes from process to process, so the same tensors and metadata gave different bytes (and hashes).
    The header keeps its length; one whose re-serialisation would not is left as it is."""
    with open(path, "r+b") as f:
        head = f.read(8)
        if len(head) < 8:
            return
        (n,) = struct.unpack("<Q", head)
        raw = f.read(n)
        try:
            header = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return
        meta = header.get("__metadata__") if isinstance(header, dict) else None
        if not isinstance(meta, dict) or len(meta) < 2:
            return
        header = {"__metadata__": dict(sorted(meta.items())), **{k: v for k, v in header.items()
                                                                 if k != "__metadata__"}}
        new = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        if len(new) != len(raw.rstrip(b" ")):
            return
        f.seek(8)
        f.write(new.ljust(n, b" "))


def _finish(paths) -> None:
    """Written files with the mode a plain open() gives them under the umask: some writers (safetensors)
    create theirs 0600, and a rename keeps it, so a team sharing the directory could not read the weights."""
    mode = new_file_mode()
    for p in paths:
        if p.is_file() and not p.is_symlink():
            os.chmod(p, mode)


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None
                     ) -> None:
    """safetensors' save_file with the header in one byte order (canonical_safetensors), for files written
    inside an atomic_dir: the same tensors give the same bytes, and so the same recorded hash."""
    save_file(tensors, str(path), metadata=metadata)
    canonical_safetensors(Path(path))


@contextlib.contextmanager
def atomic_path(path: str | Path):
    """Yield a temporary sibling path to write one file to; on normal exit it replaces `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_sibling(path)
    try:
        yield tmp
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if path.suffix == ".safetensors":  # before anything hashes it (the temporary name has another suffix)
        canonical_safetensors(tmp)
    _finish([tmp])
    os.replace(tmp, path)


@contextlib.contextmanager
def atomic_dir(path: str | Path, overwrite: bool = False):
    """Yield a temporary directory; on normal exit it becomes `path` (renamed). An existing directory is
    replaced only when `overwrite`, and only after the new one is complete."""
    path = Path(path)
    if path.exists() and not overwrite:
        raise SmeltError(f"output directory {path} already exists (pass --overwrite to replace it)")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_sibling(path)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _finish(tmp.rglob("*"))
    old = None
    if path.exists():
        old = _tmp_sibling(path, "old")
        os.rename(path, old)
    os.rename(tmp, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def atomic_write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def read_json(path: str | Path, what: str):
    """A JSON file that must exist; a missing or unparsable one is one line naming the file and `what` it is."""
    path = Path(path)
    if not path.is_file():
        raise SmeltError(f"{path.parent} has no {path.name} (not {what})")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SmeltError(f"{path} is not valid JSON ({e})") from None


def atomic_save_safetensors(tensors: dict[str, torch.Tensor], path: str | Path,
                            metadata: dict[str, str] | None = None) -> None:
    with atomic_path(path) as tmp:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp), metadata=metadata)


def _unreadable(path: Path, e: Exception) -> SmeltError:
    return SmeltError(f"{path} is not a readable safetensors file (truncated or corrupt: {str(e).strip()})")


def safetensors_metadata(path: str | Path) -> dict[str, str]:
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except (SafetensorError, OSError) as e:
        raise _unreadable(path, e) from None


def check_finite(name: str, t: torch.Tensor, where: str | Path) -> None:
    """Refuse a float tensor holding NaN/inf, naming it (a NaN weight would evaluate as a table of nan)."""
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        raise SmeltError(f"{where}: tensor {name} has {bad} non-finite value(s) (NaN/inf); refusing to load it")


@contextlib.contextmanager
def open_safetensors(path: str | Path):
    """safe_open for reading; a missing, truncated or corrupt file is one line naming it (at open or on read)."""
    path = Path(path)
    if not path.is_file():
        raise SmeltError(f"{path} does not exist")
    try:
        with safe_open(str(path), framework="pt") as f:
            yield f
    except (SafetensorError, OSError) as e:
        raise _unreadable(path, e) from None


def iter_safetensors(path: str | Path):
    """Yield (name, tensor) from one safetensors file, each checked finite."""
    with open_safetensors(path) as f:
        for name in list(f.keys()):
            t = f.get_tensor(name)
            check_finite(name, t, path)
            yield name, t


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file; SmeltError naming the file if it is truncated or corrupt."""
    return dict(iter_safetensors(path))
