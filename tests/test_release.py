"""Release export (qat.release) and its checker (qat.verify) on a tiny 2:4-pruned, int4-QAT model."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import make_qat_artifact
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from core.artifact import parent_record, write_manifest
from core.errors import SmeltError, run_cli
from core.masks import MASKS_FILE
from core.release_layout import pack_mask, unpack_mask
from qat import release as release_mod
from qat.qparams import QPARAMS_FILE
from qat.quantizers import QuantSpec
from qat.release import build_release, stage_chain
from qat.verify import verify_release

SPEC = QuantSpec(group_size=32)
TOKENS = torch.tensor([[1, 72, 101, 108, 108, 111, 44, 32, 119, 2]])
UP = "model.layers.0.mlp.up_proj"
Q = "model.layers.1.self_attn.q_proj"
PROTECTED = [("1", 2)]  # a protected head of layer 1: its q rows and its KV group's k/v rows stay dense


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> tuple[Path, torch.Tensor]:
    return make_qat_artifact(tmp_path_factory.mktemp("art"), SPEC, PROTECTED, TOKENS)


@pytest.fixture(scope="module")
def release(artifact, tmp_path_factory) -> Path:
    # fp32 non-quantized tensors: logits comparable to the fake-quantized model's at fp32 precision
    return build_release(artifact[0], tmp_path_factory.mktemp("rel") / "release", dtype="float32")


def _copy(src: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(src, tmp_path / src.name))


def _rewrite(path: Path, edit) -> None:
    """Apply edit(tensors, metadata) to a safetensors file in place."""
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(str(path))
    edit(tensors, meta)
    save_file(tensors, str(path), metadata=meta)


def test_release_loads_in_transformers_with_our_logits(artifact, release):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(release), dtype=torch.float32)
    with torch.no_grad():
        logits = hf(TOKENS).logits
    assert (logits - artifact[1]).abs().max().item() <= 1e-4

    qc = json.loads((release / "config.json").read_text())["quantization_config"]
    assert qc["sparsity_config"] == {} and qc["format"] == "pack-quantized"
    assert qc["quantization_status"] == "compressed" and "lm_head" in qc["ignore"]
    w = qc["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["strategy"], w["group_size"], w["symmetric"]) == (4, "group", 32, True)
    with safe_open(str(release / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor(f"{UP}.weight_packed").dtype == torch.int32
        names = set(f.keys())
        assert f"{UP}.weight" not in names and "model.embed_tokens.weight" in names
    assert (release / "mtp.safetensors").read_bytes() == (artifact[0] / "mtp.safetensors").read_bytes()

    man = json.loads((release / "smelt_release.json").read_text())
    assert [s["stage"] for s in man["stages"]] == ["source", "prune", "qat"] and man["metrics"] == {"ppl": 12.5}
    assert man["stages"][1]["settings"] == {"pattern": "2:4"}
    assert set(man["files"]) == {p.name for p in release.iterdir()} - {"smelt_release.json"}
    masks = load_file(str(artifact[0] / MASKS_FILE))
    dense = {k.removesuffix(".weight_dense_rows") for k in masks if k.endswith(".weight_dense_rows")}
    assert dense == {Q, Q.replace("q_proj", "k_proj"), Q.replace("q_proj", "v_proj")}
    bits = load_file(str(release / "sparsity.safetensors"))
    modules = json.loads((release / "sparsity.json").read_text())["modules"]
    assert set(modules) == set(masks) - {k for k in masks if k.endswith("dense_rows")}
    assert torch.equal(unpack_mask(bits[f"{UP}.keep_bits"], 64), masks[UP])
    # head 2 of 4 (head_dim 16) -> q rows 32..48; GQA 4/2 -> KV group 1 -> k/v rows 16..32
    assert modules[Q]["dense_rows"] == [[32, 48]] and modules[Q.replace("q_proj", "k_proj")]["dense_rows"] == [[16, 32]]
    assert "dense_rows" not in modules[UP]
    assert unpack_mask(bits[f"{Q}.keep_bits"], 64)[32:48].all()


def test_pack_mask_roundtrip_and_nibble_layout():
    mask = torch.rand(3, 12) > 0.5  # 12 inputs: padded to 16 bits
    assert torch.equal(unpack_mask(pack_mask(mask), 12), mask)
    one = torch.zeros(1, 8, dtype=torch.bool)
    one[0, [1, 2, 4, 7]] = True  # group 0 keeps positions 1, 2; group 1 keeps 0, 3
    assert pack_mask(one).tolist() == [[0b1001_0110]]


def test_verify_passes(release, capsys):
    from qat.verify import main

    assert verify_release(release).failures == []
    assert main([str(release), "--no-load"]) == 0
    assert "PASSED" in capsys.readouterr().out


def test_verify_holds_other_rows_of_a_module_with_dense_rows_to_24(release, tmp_path):
    """Declared dense rows are exempt from the 2:4 check; an undeclared dense row is not."""
    rel = _copy(release, tmp_path)
    meta = json.loads((rel / "sparsity.json").read_text())
    meta["modules"][Q]["dense_rows"] = [[32, 40]]  # half the protected rows left undeclared
    (rel / "sparsity.json").write_text(json.dumps(meta))
    fails = verify_release(rel, load=False).failures
    assert any(f.startswith(f"{Q}: ") and "groups of 4 have more than 2 non-zero" in f for f in fails), fails


def test_release_records_mtp_acceptance_and_verify_reproduces_it(release, tmp_path, capsys):
    from qat.verify import main

    rec = json.loads((release / "smelt_release.json").read_text())["settings"]["mtp"]
    assert rec["depth"] == 1 and rec["file"] == "mtp.safetensors" and rec["trained_on_released_model"] is True
    assert len(rec["probe"]["prompts"]) == 6 and 0 <= rec["probe"]["alpha_first"] <= 1
    assert main([str(release)]) == 0
    assert "MTP depth 1: greedy acceptance" in capsys.readouterr().out
    rel = _copy(release, tmp_path)
    man = json.loads((rel / "smelt_release.json").read_text())
    man["settings"]["mtp"]["probe"]["alpha_first"] += 0.5  # a record the MTP file does not reproduce
    (rel / "smelt_release.json").write_text(json.dumps(man))
    fails = verify_release(rel).failures
    assert len(fails) == 1 and fails[0].startswith("MTP acceptance"), fails
    man["settings"]["mtp"]["probe"]["alpha_first"] -= 0.5
    man["settings"]["mtp"]["fuse_layers"] = [0]  # a record that names blocks the file's module does not read
    (rel / "smelt_release.json").write_text(json.dumps(man))
    fails = verify_release(rel).failures
    assert fails == ["MTP modules: SmeltError: settings.mtp.fuse_layers=[0] in smelt_release.json, the file holds []"], fails


def test_a_model_too_large_for_memory_releases_and_verifies_a_block_at_a_time(artifact, release, tmp_path,
                                                                              monkeypatch, capsys):
    """Past models.source_model.RESIDENT_BYTES (here 0) the MTP probe streams the artifact's blocks, and verify
    loads the release into transformers cut to one block and runs the whole of it a block at a time: the same
    probe, and every check passing."""
    import models.source_model
    import qat.verify
    from qat.verify import main

    monkeypatch.setattr(models.source_model, "RESIDENT_BYTES", 0)
    monkeypatch.setattr(qat.verify, "RESIDENT_BYTES", 0)
    monkeypatch.setattr(qat.verify, "CUT_VOCAB", 100)
    streamed = build_release(artifact[0], tmp_path / "release", dtype="float32")
    probe = json.loads((streamed / "smelt_release.json").read_text())["settings"]["mtp"]["probe"]
    assert probe == json.loads((release / "smelt_release.json").read_text())["settings"]["mtp"]["probe"]
    assert main([str(streamed)]) == 0
    out = capsys.readouterr().out
    assert "loads its first block and 100 vocabulary rows" in out and "read a block at a time, gives finite" in out, out
    assert "MTP depth 1: greedy acceptance" in out


def test_verify_catches_flipped_byte(release, tmp_path):
    rel = _copy(release, tmp_path)
    data = bytearray((rel / "model.safetensors").read_bytes())
    data[-3] ^= 0xFF  # in the tensor data, so the file still parses
    (rel / "model.safetensors").write_bytes(bytes(data))
    fails = verify_release(rel, load=False).failures
    assert any(f.startswith("model.safetensors: sha256 does not match") for f in fails), fails


def test_verify_catches_wrong_group_size(release, tmp_path):
    rel = _copy(release, tmp_path)
    cfg = json.loads((rel / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 64
    (rel / "config.json").write_text(json.dumps(cfg))
    fails = verify_release(rel, load=False).failures
    assert any("config.json: sha256" in f for f in fails)
    assert any(f.startswith(f"{UP}: weight_scale shape (128, 2) does not match") for f in fails), fails


def test_verify_decompresses_to_check_24(release, tmp_path):
    """A weight set where the mask removes it, in the packed codes themselves, is caught."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    rel = _copy(release, tmp_path)
    masks = unpack_mask(load_file(str(rel / "sparsity.safetensors"))[f"{UP}.keep_bits"], 64)
    row, col = (~masks).nonzero()[0].tolist()

    def edit(t, _):
        q = unpack_from_int32(t[f"{UP}.weight_packed"], 4, t[f"{UP}.weight_shape"])
        q[row, col] = 3
        t[f"{UP}.weight_packed"] = pack_to_int32(q, 4)

    _rewrite(rel / "model.safetensors", edit)
    fails = verify_release(rel, load=False).failures
    assert f"{UP}: 1 groups of 4 have more than 2 non-zero weights (declared 2:4)" in fails, fails
    assert f"{UP}: 1 weights are non-zero where the 2:4 mask removes them" in fails


def _cli_error(capsys, *argv: str) -> str:
    capsys.readouterr()  # what earlier calls printed (progress bars)
    with pytest.raises(SystemExit) as e:
        run_cli(lambda: release_mod.main(list(argv)))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    return err


def test_release_refuses_broken_mask(artifact, tmp_path, capsys):
    art = _copy(artifact[0], tmp_path)
    mask = load_file(str(art / MASKS_FILE))[UP]

    def edit(t, _):
        w = t[f"{UP}.weight"]
        w[~mask] = torch.where(torch.arange(int((~mask).sum())) < 5, 0.01, 0.0)  # 5 masked weights revived

    _rewrite(art / "model.safetensors", edit)
    err = _cli_error(capsys, "--artifact", str(art), "--out", str(tmp_path / "rel"))
    assert err == f"error: {UP}: 5 weights are non-zero where the 2:4 mask removes them"
    assert not (tmp_path / "rel").exists()


def test_stage_chain_stops_at_a_replaced_parent(tmp_path):
    """A parent directory overwritten by another stage since is not followed: the child's record is kept."""
    for d in ("src", "a", "b"):
        (tmp_path / d).mkdir()
    write_manifest(tmp_path / "a", "prune", {"pattern": "2:4"}, parent=parent_record(tmp_path / "src"))
    child = write_manifest(tmp_path / "b", "distill", {"steps": 3}, parent=parent_record(tmp_path / "a"))
    assert [s["stage"] for s in stage_chain(child)] == ["source", "prune", "distill"]
    write_manifest(tmp_path / "a", "prune", {"pattern": "4:8"})  # replaced, no parent of its own
    chain = stage_chain(child)
    assert [s["stage"] for s in chain] == ["prune", "distill"] and chain[0]["settings"] == {"pattern": "2:4"}


def test_release_refuses_a_mask_that_breaks_the_declared_pattern(artifact, tmp_path, capsys):
    art = _copy(artifact[0], tmp_path)

    def edit(t, _):
        t[UP][0, :4] = True  # one group of 4 keeps all 4: no longer 2:4 (weights are irrelevant here)

    _rewrite(art / MASKS_FILE, edit)
    err = _cli_error(capsys, "--artifact", str(art), "--out", str(tmp_path / "rel"))
    assert err == f"error: {MASKS_FILE}: {UP} breaks the 2:4 pattern its prune stage declared"
    assert not (tmp_path / "rel").exists()


def test_release_keeps_the_evaluation_of_its_own_artifact(artifact, tmp_path, capsys):
    ev = {"model": str(artifact[0]), "teacher": "t", "buckets": {"en": {"kl_mean": 0.1}}, "settings": {}}
    (tmp_path / "ev.json").write_text(json.dumps(ev))
    rel = build_release(artifact[0], tmp_path / "rel", metrics_file=tmp_path / "ev.json")
    assert json.loads((rel / "smelt_release.json").read_text())["metrics"] == {"ppl": 12.5, "eval": ev}
    (tmp_path / "other.json").write_text(json.dumps({**ev, "model": str(tmp_path)}))
    err = _cli_error(capsys, "--artifact", str(artifact[0]), "--out", str(tmp_path / "rel2"),
                     "--metrics", str(tmp_path / "other.json"))
    assert err == (f"error: --metrics {tmp_path / 'other.json'} evaluated {tmp_path}, not the artifact "
                   f"{artifact[0]} (nor its main model)")
    assert not (tmp_path / "rel2").exists()
    # an artifact with the same main model (MTP modules re-aligned on it, frozen) keeps that evaluation
    twin = _copy(artifact[0], tmp_path / "twin")
    rel = build_release(twin, tmp_path / "rel3", metrics_file=tmp_path / "ev.json")
    assert json.loads((rel / "smelt_release.json").read_text())["metrics"]["eval"] == ev


def test_release_refuses_off_grid_weights(artifact, tmp_path):
    art = _copy(artifact[0], tmp_path)
    (art / MASKS_FILE).unlink()  # unmasked, so only the grid check can object
    _rewrite(art / "model.safetensors", lambda t, _: t[f"{UP}.weight"].mul_(1.01))
    with pytest.raises(SmeltError, match=f"weights of {UP} are not on the int4 grid of qparams.safetensors"):
        build_release(art, tmp_path / "rel")


@pytest.mark.parametrize("spec_edit, message", [
    ({"group_size": 48}, "group_size=48 does not divide in_features="),
    ({"group_size": 64}, "(group_size=64 per its metadata)"),
    ({"bits": 3}, "bits=3 is not supported"),
    ({"symmetric": False}, "asymmetric quantisation cannot be released"),
    (None, "not a quantized artifact"),
])
def test_release_refuses_bad_input(artifact, tmp_path, capsys, spec_edit, message):
    art = _copy(artifact[0], tmp_path)
    if spec_edit is None:
        (art / QPARAMS_FILE).unlink()
    else:
        def edit(_, meta):
            meta["spec"] = json.dumps({**json.loads(meta["spec"]), **spec_edit})

        _rewrite(art / QPARAMS_FILE, edit)
    assert message in _cli_error(capsys, "--artifact", str(art), "--out", str(tmp_path / "rel"))
    assert not (tmp_path / "rel").exists()


def test_interrupted_export_leaves_no_release(artifact, release, tmp_path, monkeypatch):
    def boom(*_):
        raise KeyboardInterrupt  # mid-write: model.safetensors is already in the temp dir

    monkeypatch.setattr(release_mod, "pack_mask", boom)
    with pytest.raises(KeyboardInterrupt):
        build_release(artifact[0], tmp_path / "rel")
    assert list(tmp_path.iterdir()) == []
    # over an existing release: the old one survives untouched
    old = _copy(release, tmp_path)
    before = {p.name: p.read_bytes() for p in old.iterdir()}
    with pytest.raises(KeyboardInterrupt):
        build_release(artifact[0], old, overwrite=True)
    assert {p.name: p.read_bytes() for p in old.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == [old.name]
    with pytest.raises(SmeltError, match="already exists"):
        build_release(artifact[0], old)
