"""configs/recipes/smollm2-cpu-mtp.toml: the default recipe's chain plus its MTP stages (commands checked against
the default's dry run), and the MTP training configs it names."""
from __future__ import annotations

import json

from conftest import ROOT
from test_recipe import _cli, _dry_run

from models.hf_io import config_to_hf
from models.llama import FLAVORS

RECIPES = ROOT / "configs" / "recipes"


def test_smollm2_mtp_recipe_is_the_default_chain_plus_its_mtp_stages(capsys, tmp_path):
    """smollm2-cpu-mtp.toml extends the default: every stage of the default recipe with the same commands and
    evaluations (GPTQ reads the artifact that carries the module, the release the re-aligned one), and the four
    MTP stages on the texts their main models wrote."""
    smol = tmp_path / "smollm2-config"
    smol.mkdir()
    (smol / "config.json").write_text(json.dumps(config_to_hf(FLAVORS["smollm2-135m"])))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    _, default = _dry_run(capsys, RECIPES / "smollm2-cpu.toml", tmp_path / "a", "--teacher-config", smol,
                          "--set", f"run_dir={tmp_path}/run")
    _, mtp = _dry_run(capsys, RECIPES / "smollm2-cpu-mtp.toml", tmp_path / "b", "--teacher-config", smol,
                      "--set", f"run_dir={tmp_path}/run")
    base, stages = {s["name"]: s for s in default["stages"]}, {s["name"]: s for s in mtp["stages"]}
    assert list(stages) == ["teacher", "heads", "prune", "reconstruct", "recover", "self-text", "mtp", "quantize",
                            "qreconstruct", "qat", "qat-text", "realign", "release", "verify", "report"]
    assert [n for n in stages if n in base] == list(base)
    run = f"{tmp_path}/run"
    moved = {"quantize": (f"--artifact {run}/recovered-2of4 ", f"--artifact {run}/mtp-2of4 "),
             "release": (f"--artifact {run}/qat-2of4 ", f"--artifact {run}/qat-2of4-mtp ")}
    for name, want in base.items():
        old, new = moved.get(name, ("", ""))
        assert [c.replace(old, new) for c in want["commands"]] == stages[name]["commands"], name
        assert want["evaluation"] == stages[name]["evaluation"], name
    # its own run_dir unless overridden, and its own catalogue line
    _, own = _dry_run(capsys, RECIPES / "smollm2-cpu-mtp.toml", tmp_path / "b", "--teacher-config", smol)
    assert own["recipe"] == "smollm2-cpu-mtp" and own["run_dir"] == "runs/smollm2-mtp"
    assert stages["self-text"]["tokens"] == 1280 * 128 and stages["qat-text"]["tokens"] == 1280 * 128
    assert "--prompt-len 128 " in stages["self-text"]["commands"][0] and "--seed 2 " in stages["qat-text"]["commands"][0]
    # KL to the main model only, on text half of which is real: the realign stage at its lower lr
    assert "--config smollm2_mtp_kl_fused " in stages["mtp"]["commands"][0]
    assert "--config smollm2_mtp_realign_kl_fused " in stages["realign"]["commands"][0]
    assert stages["mtp"]["commands"][0].endswith(f"--dataloader.source {run}/self-text/text.jsonl")
    assert f"--student {run}/qat-2of4 " in stages["realign"]["commands"][0]
    assert stages["realign"]["commands"][0].endswith(f"--dataloader.source {run}/qat-text/text.jsonl")
    assert stages["mtp"]["evaluation"] is None and stages["realign"]["evaluation"] is None
    # the release keeps the QAT'd main model's evaluation (the realign stage trains only the module)
    assert stages["release"]["commands"][0].endswith(f"--metrics {run}/evals/qat-2of4.json")
    # re-aligning with modules for other blocks would fail only at its load, hours into the chain
    code, _, err = _cli(capsys, RECIPES / "smollm2-cpu-mtp.toml", "--dry-run", "--teacher-config", smol, "--set",
                        "stages.realign.config=smollm2_mtp_realign_kl")
    assert code == 2 and err.strip().splitlines()[-1].endswith(
        "stages[11].config 'smollm2_mtp_realign_kl' builds modules reading main-model blocks [] (mtp.fuse_layers); "
        "the module it continues, stage 'mtp''s, reads [2, 15, 27]"), err
    _dry_run(capsys, RECIPES / "smollm2-cpu-mtp.toml", tmp_path / "b", "--teacher-config", smol, "--set",
             "stages.mtp.config=smollm2_mtp_kl", "--set", "stages.realign.config=smollm2_mtp_realign_kl")


def test_smollm2_mtp_configs_distil_only_the_main_model():
    """The MTP chain's training configs: KL to the frozen main model, no CE; re-alignment at the lower lr; the
    fused pair reads the same blocks (a re-alignment must load the module it continues)."""
    from train import cpu_shims

    cpu_shims.apply()  # before torchtitan is first imported in this process (as every entry point does)
    from train import config_registry as r
    for make, lr in ((r.smollm2_mtp_kl, 5e-4), (r.smollm2_mtp_realign_kl, 1e-4), (r.smollm2_mtp_kl_fused, 5e-4),
                     (r.smollm2_mtp_realign_kl_fused, 1e-4)):
        cfg = make()
        assert cfg.loss.ce_weight == 0.0 and cfg.model_spec.model.mtp.target == "main", make.__name__
        assert cfg.optimizer.param_groups[0].optimizer_kwargs["lr"] == lr, make.__name__
    fused = {make().model_spec.model.mtp.fuse_layers for make in (r.smollm2_mtp_kl_fused, r.smollm2_mtp_realign_kl_fused)}
    assert fused == {(2, 15, 27)}
