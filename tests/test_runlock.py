"""core.runlock on a file system without flock: the exclusive-create lock file, taken over only from a
holder that is gone."""
from __future__ import annotations

import errno
import json
import socket
import subprocess
import sys

import pytest

from core import runlock
from core.errors import SmeltError
from core.runlock import EXCL_NAME, RunLock, check_free


@pytest.fixture
def no_flock(monkeypatch):
    def refuse(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(runlock.fcntl, "flock", refuse)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)


def _dead_pid() -> int:
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                       check=True)
    return int(p.stdout)


def _left(folder, **holder):
    (folder / EXCL_NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": _dead_pid(), "job": "",
                                                "started": "earlier", **holder}))


def test_without_flock_one_live_run_holds_the_folder_and_release_frees_it(tmp_path, no_flock):
    lock = RunLock(tmp_path).acquire()
    held = json.loads((tmp_path / EXCL_NAME).read_text())
    assert held["pid"] > 0 and held["host"] == socket.gethostname()
    with pytest.raises(SmeltError, match=r"in use by a live run \(pid \d+ on "):
        RunLock(tmp_path).acquire()  # this process is alive: refused by name
    with pytest.raises(SmeltError, match="in use"):
        check_free(tmp_path)
    lock.release()
    assert not (tmp_path / EXCL_NAME).exists()
    RunLock(tmp_path).acquire().release()


def test_without_flock_a_gone_holder_is_taken_over_and_no_other(tmp_path, no_flock, monkeypatch):
    _left(tmp_path)  # this host, a pid that exited
    lock = RunLock(tmp_path).acquire()
    assert json.loads((tmp_path / EXCL_NAME).read_text())["started"] != "earlier"
    lock.release()
    _left(tmp_path, host="another-node")  # its pid cannot be checked from here: refused
    with pytest.raises(SmeltError, match="on another-node"):
        RunLock(tmp_path).acquire()
    _left(tmp_path, host="another-node", job="4242")  # the same Slurm job, requeued onto this node
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    RunLock(tmp_path).acquire().release()
