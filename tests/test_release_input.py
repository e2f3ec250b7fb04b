"""Every command that takes a model takes a release too: models.load decompresses it (codes x scales, 2:4
zeros exact) with its MTP modules, and eval.evaluate, eval.needle and eval.speculative run on it."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import make_qat_artifact
from safetensors.torch import load_file, save_file

from core.errors import SmeltError, run_cli
from core.masks import MASKS_FILE
from models.hf_io import load_hf
from models.load import is_release, load_model, load_model_mtp
from models.mtp import MTP_FILE
from qat import release as release_mod
from qat.quantizers import QuantSpec

SPEC = QuantSpec(group_size=32)
TOKENS = torch.tensor([[1, 72, 101, 108, 108, 111, 44, 32, 119, 2]])
PROTECTED = [("1", 2)]  # dense rows in q/k/v of layer 1: the release declares them


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> tuple[Path, torch.Tensor, Path]:
    """(QAT artifact, the fake-quantized model's logits, its release with fp32 non-quantized tensors)."""
    root = tmp_path_factory.mktemp("chain")
    art, ref = make_qat_artifact(root, SPEC, PROTECTED, TOKENS)
    with pytest.MonkeyPatch.context() as mp:  # a shorter acceptance probe: the record is not what is tested
        mp.setitem(release_mod.MTP_PROBE, "per_bucket", 1)
        mp.setitem(release_mod.MTP_PROBE, "new_tokens", 8)
        rel = release_mod.build_release(art, root / "release", dtype="float32")
    return art, ref, rel


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS)


def test_a_release_decompresses_to_the_weights_qat_trained(chain, tmp_path):
    art, ref, rel = chain
    assert is_release(rel) and not is_release(art)
    model, artifact = load_model(rel), load_hf(art)
    assert (_logits(model) - _logits(artifact)).abs().max().item() <= 1e-6
    assert (_logits(model) - ref).abs().max().item() <= 1e-4
    ours, theirs = model.state_dict(), artifact.state_dict()
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    masks = load_file(str(art / MASKS_FILE))
    up = model.get_submodule("layers.0.feed_forward.w3").weight
    assert (up[~masks["model.layers.0.mlp.up_proj"]] == 0).all()  # the 2:4 zeros stay exact zeros
    assert (up.reshape(-1, 4) != 0).sum(-1).max().item() <= 2
    half = load_model(rel, dtype=torch.bfloat16)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    assert torch.equal(half.get_submodule("layers.0.feed_forward.w3").weight, up.to(torch.bfloat16))

    # the compressed 2:4 storage (kept codes + position metadata) decompresses to the same model
    plain = Path(shutil.copytree(art, tmp_path / "art"))
    (plain / MTP_FILE).unlink()
    comp = release_mod.build_release(plain, tmp_path / "compressed", dtype="float32", sparse_storage="compressed")
    assert json.loads((comp / "sparsity.json").read_text())["storage"] == "compressed"
    assert torch.equal(_logits(load_model(comp)), _logits(model))
    assert load_model_mtp(comp, load_model(comp)) is None


def test_the_release_mtp_modules_belong_to_the_artifact_it_was_built_from(chain, tmp_path):
    art, _, rel = chain
    model = load_model(rel)
    heads = load_model_mtp(rel, model)
    own = load_model_mtp(art, load_hf(art))
    assert heads.depth == 1
    assert all(torch.equal(a, b) for a, b in zip(heads.state_dict().values(), own.state_dict().values()))
    moved = Path(shutil.copytree(rel, tmp_path / "rel"))
    man = json.loads((moved / "smelt_release.json").read_text())
    man["settings"]["mtp"]["released_main_model"] = "0" * 64  # built from another artifact than the modules'
    (moved / "smelt_release.json").write_text(json.dumps(man))
    with pytest.raises(SmeltError, match=r"mtp.safetensors: trained against another main model .* the release was "
                                         r"built from 000000000000\)$"):
        load_model_mtp(moved, model)
    assert load_model_mtp(moved, model, any_main_model=True).depth == 1


def test_evaluate_runs_on_a_release_and_measures_its_artifact(chain, tmp_path, capsys):
    from eval.evaluate import main

    art, _, rel = chain
    common = ["--teacher", str(art), "--windows", "en=2,code=1", "--seq-len", "64", "--batch-size", "2"]
    run_cli(lambda: main(["--model", str(rel), *common, "--out", str(tmp_path / "rel.json")]))
    run_cli(lambda: main(["--model", str(art), *common, "--out", str(tmp_path / "art.json")]))
    got, want = (json.loads((tmp_path / f"{n}.json").read_text())["buckets"] for n in ("rel", "art"))
    for bucket in ("en", "code"):
        assert got[bucket]["top1_agree"] == 1.0 and got[bucket]["kl_mean"] <= 1e-5, got[bucket]
        assert got[bucket]["ppl"] == pytest.approx(want[bucket]["ppl"], rel=1e-5)
    assert f"{rel} vs teacher" in capsys.readouterr().out


def test_needle_runs_on_a_release_with_its_artifacts_answers(chain, tmp_path):
    from eval.needle import main

    art, _, rel = chain
    answers = {}
    for name, model in (("rel", rel), ("art", art)):
        run_cli(lambda m=model, n=name: main(["--model", str(m), "--teacher", str(art), "--lengths", "200",
                                              "--depths", "0,1", "--samples", "2", "--out", str(tmp_path / f"{n}.json")]))
        prompts = json.loads((tmp_path / f"{name}.json").read_text())["languages"]["en"]["prompts"]
        answers[name] = [(p["name"], p["answer"]) for p in prompts]
    assert len(answers["rel"]) == 4 and answers["rel"] == answers["art"]


def test_speculative_runs_on_a_release_with_its_mtp_modules(chain, tmp_path):
    from eval.speculative import main

    art, _, rel = chain
    runs = {}
    for name, model in (("rel", rel), ("art", art)):
        out = tmp_path / f"{name}.json"
        run_cli(lambda m=model, o=out: main(["--model", str(m), "--prompts", "2", "--prompt-len", "16",
                                             "--new-tokens", "8", "--languages", "en,code", "--no-small-m",
                                             "--out", str(o)]))
        runs[name] = json.loads(out.read_text())
    assert runs["rel"]["mtp"]["depth"] == "1" and runs["rel"]["overall"]["rounds"] > 0
    for bucket in ("en", "code"):  # the same main model and modules: the same drafts accepted, prompt for prompt
        assert runs["rel"]["buckets"][bucket]["alpha_first_per_prompt"] == \
            runs["art"]["buckets"][bucket]["alpha_first_per_prompt"]


def _edited(rel: Path, tmp_path: Path, edit) -> Path:
    out = Path(shutil.copytree(rel, tmp_path / "edited"))
    edit(out)
    return out


def _drop(name: str):
    def edit(d: Path) -> None:
        t = load_file(str(d / "model.safetensors"))
        del t[name]
        save_file(t, str(d / "model.safetensors"))
    return edit


def _config(update: dict):
    def edit(d: Path) -> None:
        c = json.loads((d / "config.json").read_text())
        c["quantization_config"].update(update)
        (d / "config.json").write_text(json.dumps(c))
    return edit


def _truncate(d: Path) -> None:
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


@pytest.mark.parametrize("edit, message", [
    (_truncate, r"model.safetensors is not a readable safetensors file"),
    (_drop("model.norm.weight"), r"the release has no tensor for norm.weight$"),
    (_drop("model.layers.0.mlp.up_proj.weight_packed"), r"model.layers.0.mlp.up_proj lacks weight_packed$"),
    (_config({"quant_method": "gptq"}), r"quantization_config is gptq pack-quantized, smelt reads releases in "
                                        r"compressed-tensors pack-quantized"),
])
def test_a_broken_release_is_one_line(chain, tmp_path, edit, message):
    bad = _edited(chain[2], tmp_path, edit)
    with pytest.raises(SmeltError, match=message) as e:
        load_model(bad)
    assert "\n" not in str(e.value)
