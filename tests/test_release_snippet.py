"""The README's release-loading snippet runs as written on a release, and transformers gives what smelt's own
decompression of that release gives: the same logits within bf16 precision, and greedy tokens smelt would
pick too."""
from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest
import torch
from conftest import ROOT, make_qat_artifact
from safetensors.torch import load_file

from core.masks import MASKS_FILE
from models.load import load_model
from qat import release as release_mod
from qat.quantizers import QuantSpec

MARKER = "<!-- snippet: load-release -->"
PLACEHOLDER = "runs/smollm2/release"
TOKENS = torch.tensor([[1, 72, 101, 108, 108, 111, 44, 32, 119, 2]])


def readme_snippet(text: str) -> str:
    """The fenced python block right after the marker line."""
    lines = text.splitlines()
    if MARKER not in lines:
        raise AssertionError(f"README.md has no line {MARKER}")
    rest = lines[lines.index(MARKER) + 1:]
    if not rest or rest[0].strip() != "```python":
        raise AssertionError(f"README.md: the line after {MARKER} does not open a ```python block")
    end = next((i for i, ln in enumerate(rest[1:], 1) if ln.strip() == "```"), None)
    if end is None:
        raise AssertionError("README.md: the release snippet's block is not closed")
    return "\n".join(rest[1:end]) + "\n"


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> tuple[Path, Path]:
    """(QAT artifact, its release as qat.release writes it by default: bf16, 2:4 keep-bits, MTP modules)."""
    root = tmp_path_factory.mktemp("snippet")
    art, _ = make_qat_artifact(root, QuantSpec(group_size=32), [("1", 2)], TOKENS)
    with pytest.MonkeyPatch.context() as mp:  # a shorter acceptance probe: the record is not what is tested
        mp.setitem(release_mod.MTP_PROBE, "per_bucket", 1)
        mp.setitem(release_mod.MTP_PROBE, "new_tokens", 8)
        return art, release_mod.build_release(art, root / "release")


def test_the_readme_snippet_loads_the_release_as_smelt_decompresses_it(release):
    art, rel = release
    code = readme_snippet((ROOT / "README.md").read_text())
    assert code.count(PLACEHOLDER) == 1, code
    assert {"sparsity.safetensors", "mtp.safetensors"} <= {p.name for p in rel.iterdir()}
    scope: dict = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), torch.no_grad():
        exec(compile(code.replace(PLACEHOLDER, str(rel)), "README.md (load-release)", "exec"), scope)
    model, tokenizer, inputs, out = (scope[k] for k in ("model", "tokenizer", "inputs", "out"))
    assert printed.getvalue() == tokenizer.decode(out[0], skip_special_tokens=True) + "\n"
    served = json.loads((rel / "config.json").read_text())["torch_dtype"]
    assert str(model.dtype) == f"torch.{served}"  # as the snippet loads it: the release's serving dtype

    # compressed-tensors decompressed it (on the first forward): dense weights, the 2:4 zeros exact
    up = model.model.layers[0].mlp.up_proj
    params = {n for n, _ in up.named_parameters()}
    assert "weight" in params and "weight_packed" not in params, params
    keep = load_file(str(art / MASKS_FILE))["model.layers.0.mlp.up_proj"]
    assert (up.weight[~keep] == 0).all() and (up.weight[keep] != 0).float().mean() > 0.9
    # the side files are not model weights to transformers: nothing of the MTP modules or keep-bits is in it
    assert not [k for k in model.state_dict() if "mtp" in k or "keep_bits" in k]

    ours = load_model(rel)  # smelt's decompression, fp32: codes x fp32 scales
    ids = out[:, :-1]
    with torch.no_grad():
        theirs, want = model(ids).logits[0].float(), ours(ids)[0]
    bound = 0.02 * want.abs().max().item()  # bf16 weights and activations against fp32
    assert (theirs - want).abs().max().item() <= bound
    assert (theirs.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.9
    start = inputs["input_ids"].shape[1]
    new = out[0, start:]
    assert len(new) > 0 and re.sub(r"\s", "", printed.getvalue())
    for pos, token in enumerate(new.tolist(), start - 1):  # each greedy pick is smelt's, up to near ties
        assert want[pos, token] >= want[pos].max() - bound, (pos, token)
