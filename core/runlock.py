"""One live run per output folder: an advisory lock file that names its holder.

A training run writes checkpoints into its dump folder and resumes from the newest one there; two live
runs on one folder would interleave checkpoints. The lock is `flock` on `<folder>/.smelt-run.lock`: the
kernel drops it when the holder dies however it dies, so a lock left by a dead run is simply taken over.
The file's content (host, pid, start time, command) only names the holder in the refusal. On a shared
file system the lock is as good as its flock support (NFSv4 and Lustre with `-o flock` support it; Lustre's
`-o localflock` locks per node only).

Where the file system has no flock at all (Lustre `-o noflock`, some NFS), the lock is the exclusive
creation of `<folder>/.smelt-run.lock.excl`, naming host, pid and Slurm job; it is removed on release, and a
file left behind is taken over only when its process is gone: the same host and no such pid, or the same
Slurm job (a requeued job, on any node). Any other holder is refused by name.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from core.errors import SmeltError

LOCK_NAME = ".smelt-run.lock"
EXCL_NAME = LOCK_NAME + ".excl"  # the lock where flock is not supported


def _holder(path: Path) -> str:
    try:
        h = json.loads(path.read_text(encoding="utf-8"))
        return f"pid {h['pid']} on {h['host']}, started {h['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


def _record() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "job": os.environ.get("SLURM_JOB_ID", ""),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)}


def _gone(path: Path) -> bool:
    """Whether the process an exclusive lock file names is gone: the same host and no such pid, or the same
    Slurm job as this process (its previous run, requeued). Unreadable or another host's: not known gone."""
    try:
        h = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(h, dict):
        return False
    if h.get("job") and h.get("job") == os.environ.get("SLURM_JOB_ID"):
        return True
    if h.get("host") != socket.gethostname() or not isinstance(h.get("pid"), int):
        return False
    try:
        os.kill(h["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


class RunLock:
    """Held from `acquire()` until `release()` or the process exits."""

    def __init__(self, folder: str | Path, what: str = "--dump_folder"):
        self.folder, self.what = Path(folder), what
        self.path = self.folder / LOCK_NAME
        self._fd: int | None = None
        self._excl: Path | None = None

    def _refuse(self, path: Path) -> SmeltError:
        return SmeltError(f"{self.what} {self.folder} is in use by a live run ({_holder(path)}); wait for it, "
                          f"stop it, or use another folder")

    def _acquire_excl(self) -> RunLock:
        """The lock without flock: create the .excl file or take over a gone holder's (once)."""
        path = self.folder / EXCL_NAME
        for _ in range(2):
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                if not _gone(path):
                    raise self._refuse(path) from None
                path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(_record()) + "\n")
            self._excl = path
            return self
        raise self._refuse(path)

    def acquire(self) -> RunLock:
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise self._refuse(self.path) from None
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):  # no flock here
                return self._acquire_excl()
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(_record()) + "\n").encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock; the file stays (harmless, names the last holder)
            self._fd = None
        if self._excl is not None:
            self._excl.unlink(missing_ok=True)
            self._excl = None


def check_free(folder: str | Path, what: str = "--dump_folder") -> None:
    """Refuse now if a live run holds the folder (a launcher's early check; the run takes the lock itself)."""
    if any((Path(folder) / name).exists() for name in (LOCK_NAME, EXCL_NAME)):
        RunLock(folder, what).acquire().release()
