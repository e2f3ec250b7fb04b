"""eval.compare_weights (smelt compare-weights): equal tensors in differently-written files are equal; a changed tensor is not."""
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]


def _run(a, b):
    return subprocess.run([sys.executable, "-m", "eval.compare_weights", a, b], check=False, capture_output=True, text=True)


def test_equal_tensors_pass_and_a_changed_tensor_fails(tmp_path):
    w = {"x": torch.arange(6.0).reshape(2, 3), "y": torch.ones(4)}
    for d, meta in (("a", {"k": "1"}), ("b", {"k": "2"})):  # other metadata: other bytes, the same tensors
        (tmp_path / d).mkdir()
        save_file(w, tmp_path / d / "model.safetensors", metadata=meta)
    r = _run(tmp_path / "a", tmp_path / "b")
    assert r.returncode == 0 and '"model.safetensors": true' in r.stdout
    save_file({**w, "y": torch.zeros(4)}, tmp_path / "b" / "model.safetensors")
    r = _run(tmp_path / "a", tmp_path / "b")
    assert r.returncode == 1 and '"model.safetensors": false' in r.stdout


def test_a_directory_without_weights_is_refused(tmp_path):
    r = _run(tmp_path, tmp_path)
    assert r.returncode != 0 and "no model.safetensors" in r.stderr and len(r.stderr.strip().splitlines()) == 1
