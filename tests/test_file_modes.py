"""Every file smelt writes has the mode a plain open() gives under the user's umask: a release handed to a
serving team on a shared file system is readable by the group the umask lets read it."""
from __future__ import annotations

import os
import stat

import pytest
import torch
from conftest import make_qat_artifact

from qat.quantizers import QuantSpec


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_artifact_and_release_files_get_the_umask_mode(tmp_path, umask):
    from qat.release import build_release

    old = os.umask(umask)
    try:
        art, _ = make_qat_artifact(tmp_path, QuantSpec(group_size=32), [("1", 2)],
                                   torch.randint(3, 200, (1, 16)))
        release = build_release(art, tmp_path / "release", dtype="float32")
    finally:
        os.umask(old)
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    names = {p.name for p in files}
    assert {"model.safetensors", "masks.safetensors", "qparams.safetensors", "manifest.json"} <= names
    assert "sparsity.safetensors" in {p.name for p in release.rglob("*")}
    wrong = {str(p.relative_to(tmp_path)): oct(stat.S_IMODE(p.stat().st_mode)) for p in files
             if stat.S_IMODE(p.stat().st_mode) != 0o666 & ~umask}
    assert not wrong, f"files not {oct(0o666 & ~umask)} under umask {oct(umask)}: {wrong}"
