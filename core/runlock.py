"""One live run per output folder: an advisory lock file that names its holder.

A training run writes checkpoints into its dump folder and resumes from the newest one there; two live
runs on one folder would interleave checkpoints. The lock is `flock` on `<folder>/.smelt-run.lock`: the
kernel drops it when the holder dies however it dies, so a lock left by a dead run is simply taken over.
The file's content (host, pid, start time, command) only names the holder in the refusal. On a shared
file system the lock is as good as its flock support (NFSv4 and Lustre with `-o flock` support it; Lustre's
`-o localflock` locks per node only).
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from core.errors import SmeltError

LOCK_NAME = ".smelt-run.lock"


def _holder(path: Path) -> str:
    try:
        h = json.loads(path.read_text(encoding="utf-8"))
        return f"pid {h['pid']} on {h['host']}, started {h['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


class RunLock:
    """Held from `acquire()` until `release()` or the process exits."""

    def __init__(self, folder: str | Path, what: str = "--dump_folder"):
        self.folder, self.what = Path(folder), what
        self.path = self.folder / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SmeltError(f"{self.what} {self.folder} is in use by a live run ({_holder(self.path)}); "
                             f"wait for it, stop it, or use another folder") from None
        except OSError as e:  # ENOSYS/ENOLCK: a file system without flock (Lustre -o noflock, some NFS)
            os.close(fd)
            raise SmeltError(f"{self.what} {self.folder}: cannot lock {self.path.name} ({e.strerror}); this "
                             f"file system does not support flock (Lustre: mount with -o flock)") from None
        record = {"host": socket.gethostname(), "pid": os.getpid(),
                  "started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock; the file stays (harmless, names the last holder)
            self._fd = None


def check_free(folder: str | Path, what: str = "--dump_folder") -> None:
    """Refuse now if a live run holds the folder (a launcher's early check; the run takes the lock itself)."""
    if (Path(folder) / LOCK_NAME).exists():
        RunLock(folder, what).acquire().release()
