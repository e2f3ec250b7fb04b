"""configs.recipe: the recipes' dry runs (shapes, commands, tokens, memory table, JSON; the MTP recipe's chain in
test_recipe_mtp.py), --list-stages,
bad input (one line, exit 2, nothing written), --set, the registry read without importing train/, and the
debug recipe's prune stage run for real on a tiny teacher."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import ROOT, tiny_config

from configs.memory import ROWS, Shape, read_registry, read_shape
from configs.recipe import main
from configs.recipe_spec import load, set_value
from core.errors import run_cli
from core.masks import load_dense_rows
from models.hf_io import config_to_hf
from models.llama import FLAVORS, build_model

RECIPES = ROOT / "configs" / "recipes"
MIX = "wikitext2-valid+code-train+zh-train"
ENV = ("SMELT_NNODES", "SMELT_NPROC", "SMELT_RDZV_ENDPOINT", "SMELT_RDZV_ID", "SMELT_LAUNCH_PREFIX")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in ENV:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(ROOT)  # recipes' relative paths (the 8B fixture) are from the repository root


def _run(*argv) -> int:
    """main() through run_cli, as `python -m configs.recipe` runs it: the exit status (0 when it returns)."""
    try:
        run_cli(lambda: main([str(a) for a in argv if a != ""]))
    except SystemExit as e:
        return e.code
    return 0


def _cli(capsys, *argv) -> tuple[int, str, str]:
    code = _run(*argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def _dry_run(capsys, recipe: Path, tmp_path: Path, *extra: str) -> tuple[str, dict]:
    code, out, err = _cli(capsys, recipe, "--dry-run", "--json", tmp_path / "plan.json", *extra)
    assert code == 0, err
    return out, json.loads((tmp_path / "plan.json").read_text())


def _check_memory(plan: dict, stages: list[str]) -> None:
    mem = {s["name"]: s["memory_gib"] for s in plan["stages"] if "memory_gib" in s}
    assert list(mem) == stages
    for m in mem.values():
        assert set(m) == {*ROWS, "total"} and all(m[r] >= 0 for r in ROWS) and m["total"] > 0
        assert m["total"] == pytest.approx(sum(m[r] for r in ROWS), abs=0.05)


def test_a_training_stages_lr_reaches_the_trainers_optimizer(capsys, tmp_path):
    """lr is passed whenever set (the registry does not read a config's lr), and torchtitan's parse takes it."""
    import shlex

    from train.run import parse_config
    smol = tmp_path / "smollm2-config"
    smol.mkdir()
    (smol / "config.json").write_text(json.dumps(config_to_hf(FLAVORS["smollm2-135m"])))
    _, plan = _dry_run(capsys, RECIPES / "smollm2-cpu.toml", tmp_path, "--teacher-config", smol,
                       "--set", f"run_dir={tmp_path}/run", "--set", "stages.qat.lr=2e-5")  # the recipe's: 2.4e-4
    stages = {s["name"]: s["commands"][0] for s in plan["stages"] if s["commands"]}
    assert "optimizer-kwargs.lr" not in stages["quantize"] and stages["qat"].endswith(
        " --optimizer.param-groups.0.optimizer-kwargs.lr 2e-05")
    args = shlex.split(stages["qat"])
    cfg = parse_config(args[args.index("--") + 1:])
    assert cfg.optimizer.param_groups[0].optimizer_kwargs["lr"] == 2e-5


def test_prune_refit_and_true_sequential_reach_their_commands(capsys, tmp_path):
    smol = tmp_path / "smollm2-config"
    smol.mkdir()
    (smol / "config.json").write_text(json.dumps(config_to_hf(FLAVORS["smollm2-135m"])))
    _, plan = _dry_run(capsys, RECIPES / "smollm2-cpu.toml", tmp_path, "--teacher-config", smol,
                       "--set", f"run_dir={tmp_path}/run",
                       "--set", "stages.quantize.calib_true_sequential=true",
                       "--set", "stages.quantize.calib_hessian=bfloat16")
    prune = next(s for s in plan["stages"] if s["name"] == "prune")
    assert len(prune["commands"]) == 1 and " --refit layer --out " in prune["commands"][0]  # the recipe's default
    _, off = _dry_run(capsys, RECIPES / "smollm2-cpu.toml", tmp_path, "--teacher-config", smol,
                      "--set", f"run_dir={tmp_path}/run", "--set", "stages.prune.refit=none")
    assert "--refit" not in next(s for s in off["stages"] if s["name"] == "prune")["commands"][0]
    assert "--calib-true-sequential" not in prune["commands"][0]
    gptq = next(s for s in plan["stages"] if s["name"] == "quantize")
    assert " --calib-hessian bfloat16 --calib-true-sequential " in gptq["commands"][0]
    assert "--calib-hessian" not in prune["commands"][0]  # None: the CLI's default


# the recipe's recover and qat windows where their configs have 4 x 256 (test_recipe_mtp: what the MTP chain keeps)
RECIPE_WINDOWS = "--training.local_batch_size 1 --training.global_batch_size 2 --training.seq_len 512"

@pytest.mark.parametrize("bf16_fast", [True, False], ids=["bf16-cpu", "no-bf16-cpu"])
def test_smollm2_cpu_plan_runs_recipe_sh_commands(capsys, tmp_path, monkeypatch, bf16_fast):
    """The recipe's dtype "auto" resolves once, at planning: bf16 training and needle where the CPU has bf16 units,
    fp32 where bf16 would be emulated (the config's own dtype: no flag)."""
    import configs.recipe_spec
    import core.data

    for module in (configs.recipe_spec, core.data):
        monkeypatch.setattr(module, "bf16_is_fast", lambda device: bf16_fast)
    bf16 = " --training.mixed_precision_param bfloat16" if bf16_fast else ""
    smol = tmp_path / "smollm2-config"
    smol.mkdir()
    (smol / "config.json").write_text(json.dumps(config_to_hf(FLAVORS["smollm2-135m"])))
    run = tmp_path / "run"
    out, plan = _dry_run(capsys, RECIPES / "smollm2-cpu.toml", tmp_path, "--teacher-config", smol,
                         "--set", f"run_dir={run}")
    m = plan["model"]
    shape = (m["layers"], m["d_model"], m["heads"], m["kv_heads"], m["ffn"], m["vocab"])
    assert shape == (30, 576, 9, 3, 1536, 49152)
    assert m["params"] == 134_515_008  # what torchtitan logs for SmolLM2-135M
    assert "30 layers, d_model 576, heads 9 / kv 3" in out and "memory per CPU rank" in out
    # scripts/recipe.sh's commands with its CPU defaults (64 / 32 x 512 calibration with bf16 forwards where the CPU
    # has them, both reconstructions on 128 x 512 for 2 epochs, 30 recovery and 214 QAT steps in bf16 mixed
    # precision on 2 x 512-token windows where the configs have 4 x 256, 1 rank, 1 block through the kernels)
    t, launch = "--teacher smollm2-135m", "python -m train.launch --nproc 1 -- --module train.config_registry"
    expected = {
        "heads": [f"python -m prune.heads {t} --top-k 4 --calib-windows 16 --out {run}/heads.json --png {run}/heads.png"],
        "prune": [(f"python -m prune.run {t} --method sparsegpt --pattern 2:4 --protect {run}/heads.json "
                  f"--skip output,tok_embeddings,attention.wq,attention.wk,attention.wv,attention.wo "
                  f"--calib-windows 64 --calib-seq-len 512 --calib-forward auto --calib-corpus {MIX} "
                  f"--refit layer --out {run}/pruned-2of4")],
        "reconstruct": [(f"python -m prune.reconstruct --artifact {run}/pruned-2of4 {t} --epochs 2 --inputs block "
                        f"--calib-windows 128 --calib-corpus {MIX} --out {run}/reconstructed-2of4")],
        "recover": [(f"{launch} --config smollm2_recover --student {run}/reconstructed-2of4 {t} --dump_folder "
                    f"{run}/recovered-2of4-run --export_dir {run}/recovered-2of4 --training.steps 30 {RECIPE_WINDOWS}"
                    f"{bf16}")],
        "quantize": [(f"python -m qat.ptq {t} --artifact {run}/recovered-2of4 --method gptq --act-order "
                     f"--group-size 64 --calib-windows 32 --calib-forward auto --calib-hessian auto --calib-corpus {MIX} "
                     f"--out {run}/gptq-2of4")],
        "qreconstruct": [(f"python -m qat.reconstruct --artifact {run}/gptq-2of4 {t} --epochs 2 --calib-windows 128 "
                         f"--calib-corpus {MIX} --out {run}/gptq-2of4-fit")],
        "qat": [(f"{launch} --config smollm2_qat --student {run}/gptq-2of4-fit {t} --dump_folder "
                f"{run}/qat-2of4-run --export_dir {run}/qat-2of4 --training.steps 214 {RECIPE_WINDOWS}"
                f"{bf16} --optimizer.param-groups.0.optimizer-kwargs.lr 0.00024")],
        "release": [(f"python -m qat.release --artifact {run}/qat-2of4 --out {run}/release --dtype bfloat16 "
                    f"--sparse-storage mask --metrics {run}/evals/qat-2of4.json")],
        "verify": [f"python -m qat.verify {run}/release",
                   f"python -m kernels.check {run}/release --layers 1 --out {run}/verify-kernels.json"],
        "report": [f"python -m eval.report --run {run}"],
    }
    stages = {s["name"]: s for s in plan["stages"]}
    assert list(stages) == ["teacher", "heads", "prune", "reconstruct", "recover", "quantize", "qreconstruct", "qat",
                            "release", "verify", "report"]
    assert stages["teacher"]["commands"] == [f"python -m models.teacher {t}", "python -m core.fetched_corpora zh-train en-news"]
    windows = " --seq-len 512 --windows en=16,zh=8,code=8,news=16 --batch-size 4" + " --needle-dtype bfloat16" * bf16_fast
    assert stages["teacher"]["evaluation"].endswith(f"--out {run}/evals/teacher.json --wandb --needle{windows}")
    assert stages["heads"]["evaluation"] is None
    for name, cmds in expected.items():
        assert stages[name]["commands"] == cmds, name
    for name, art in (("prune", "pruned-2of4"), ("reconstruct", "reconstructed-2of4"), ("recover", "recovered-2of4"),
                      ("quantize", "gptq-2of4"), ("qreconstruct", "gptq-2of4-fit"), ("qat", "qat-2of4")):
        assert stages[name]["evaluation"] == (f"python -m eval.evaluate {t} --model {run}/{art} "
                                              f"--out {run}/evals/{art}.json --wandb"
                                              + " --needle" * (name == "qat") + windows)
    assert stages["recover"]["tokens"] == 30 * 2 * 512 and stages["prune"]["tokens"] == 64 * 512
    _check_memory(plan, ["recover", "qat"])
    assert not run.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["plan.json", "smollm2-config"]


def test_llama_8b_plan_shapes_parallelism_and_memory(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("SMELT_RDZV_ENDPOINT", "node0:29500")
    monkeypatch.setenv("SMELT_LAUNCH_PREFIX", "srun --nodes=2 task.sh")
    out, plan = _dry_run(capsys, RECIPES / "llama3.1-8b-h100.toml", tmp_path)
    m = plan["model"]
    assert (m["layers"], m["d_model"], m["heads"], m["kv_heads"], m["head_dim"]) == (32, 4096, 32, 8, 128)
    assert (m["ffn"], m["vocab"], m["tied"]) == (14336, 128256, False)
    assert m["params"] == pytest.approx(8.03e9, rel=0.01)
    assert plan["parallelism"]["dp"] == 16 and "2 node(s) x 8 GPU(s) = data-parallel 16" in out
    stages = {s["name"]: s for s in plan["stages"]}
    # what this project measured, at 8B: attention dense, the protected heads' rows dense, W4 on the release's
    # g64 grid, the MTP module re-aligned on the QAT'd model's own text; the reconstructions left out, and why
    assert list(stages) == ["teacher", "heads", "prune", "recover", "mtp", "quantize", "qat", "qat-text", "realign",
                            "release", "verify", "report"]
    prune = stages["prune"]["commands"][0]
    assert "--skip output,tok_embeddings,attention.wq,attention.wk,attention.wv,attention.wo" in prune
    assert "--protect runs/llama3.1-8b/heads.json" in prune
    assert "--group-size 64" in stages["quantize"]["commands"][0]
    realign = stages["realign"]["commands"][0]
    assert "--config h100_mtp_realign --student runs/llama3.1-8b/qat-2of4 " in realign
    assert realign.endswith("--dataloader.source runs/llama3.1-8b/qat-text/text.jsonl")
    assert "--artifact runs/llama3.1-8b/qat-2of4-mtp " in stages["release"]["commands"][0]
    header = (RECIPES / "llama3.1-8b-h100.toml").read_text().split("\nname =")[0]
    assert "Left out at 8B" in header and "`reconstruct` and `qreconstruct`" in header and "The teacher:" in header
    assert "--config h100_mtp --student " in stages["mtp"]["commands"][0] and "not built" not in out
    recover = stages["recover"]["commands"][0]
    assert recover.startswith("srun --nodes=2 task.sh python -m train.launch --nproc 8 --nnodes 2 "
                              "--rdzv-endpoint node0:29500 --rdzv-id smelt -- ")
    assert "--training.local" not in recover  # restates h100_recover: nothing to override
    assert stages["qat"]["commands"][0].endswith("--training.steps 1000 --training.local_batch_size 4 "
                                                 "--training.global_batch_size 64 --training.seq_len 4096 "
                                                 "--dataloader.source hf:HuggingFaceFW/fineweb-edu:sample-10BT")
    assert stages["recover"]["budget"]["activation_checkpoint"] is True
    _check_memory(plan, ["recover", "mtp", "qat", "realign"])
    assert all(s["memory_gib"]["total"] < 80 for s in plan["stages"] if "memory_gib" in s)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def test_debug_plan_reads_the_teacher_dir_and_counts_parameters_exactly(capsys, tmp_path, tiny_model_dir):
    _out, plan = _dry_run(capsys, RECIPES / "debug.toml", tmp_path, "--set", f"teacher={tiny_model_dir}",
                         "--set", f"run_dir={tmp_path / 'run'}")
    m = plan["model"]
    assert (m["layers"], m["d_model"], m["heads"], m["kv_heads"], m["ffn"], m["vocab"]) == (2, 64, 4, 2, 128,
                                                                                             260)
    assert m["params"] == sum(p.numel() for p in build_model(tiny_config()).parameters())
    _check_memory(plan, ["recover", "mtp", "qat", "realign"])
    mtp = {s["name"]: s for s in plan["stages"]}["mtp"]
    assert "--config debug_mtp --student" in mtp["commands"][0] and mtp["input"].endswith("recovered-2of4")
    stages = {s["name"]: s for s in plan["stages"]}
    assert stages["quantize"]["input"].endswith("mtp-2of4")
    # each MTP stage trains on the text its own main model wrote (a self_text stage before it)
    assert stages["self-text"]["commands"] == [(
        f"python -m distill.self_text --model {tmp_path}/run/recovered-2of4 --teacher {tiny_model_dir} --corpus "
        f"wikitext2-valid+code-train --prompts 8 --prompt-len 16 --new-tokens 48 --batch-size 8 --out "
        f"{tmp_path}/run/self-text")]
    assert stages["self-text"]["tokens"] == 8 * 48 and stages["self-text"]["evaluation"] is None
    assert mtp["commands"][0].endswith(f"--dataloader.source {tmp_path}/run/self-text/text.jsonl")
    assert stages["qat-text"]["input"].endswith("qat-2of4") and "--seed 1" in stages["qat-text"]["commands"][0]
    assert stages["realign"]["commands"][0].endswith(f"--dataloader.source {tmp_path}/run/qat-text/text.jsonl")
    # the release packs the re-aligned artifact and keeps the evaluation of the QAT'd main model under it
    assert stages["release"]["commands"][0].endswith(
        f"--artifact {tmp_path}/run/qat-2of4-mtp --out {tmp_path}/run/release --dtype bfloat16 --sparse-storage mask "
        f"--metrics {tmp_path}/run/evals/qat-2of4.json")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flavor", ["debug", "debug-untied", "smollm2-135m"])
def test_parameter_count_matches_the_model(tmp_path, flavor):
    cfg = FLAVORS[flavor]
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(cfg)))
    with __import__("torch").device("meta"):
        model = build_model(cfg, device="meta")
    assert read_shape(tmp_path).params == sum(p.numel() for p in model.parameters())


def test_list_stages(capsys):
    code, out, _ = _cli(capsys, RECIPES / "smollm2-cpu.toml", "--list-stages")
    assert code == 0
    assert out.splitlines() == ["teacher", "heads", "prune", "reconstruct", "recover", "quantize", "qreconstruct", "qat",
                                "release", "verify", "report"]
    code, out, _ = _cli(capsys, RECIPES / "smollm2-cpu.toml", "--training-stages")  # slurm/chain.sh: all nodes
    assert code == 0 and out.splitlines() == ["recover", "qat"]


BAD = [
    (["--set", "stages.recover.stepz=2"], "stages[4].stepz"),
    (["--set", "stages.prune.calib_windows=2"], "stages[2].calib_windows=2 is fewer than the 3 corpora"),
    (["--set", "stages.heads.needle_samples=0"], "stages[1].needle_samples=0 must be >= 1"),
    (["--set", "parallelism.nproc=2", "--set", "stages.recover.global_batch=3"],
     "not divisible by local_batch 1 x data-parallel degree 2"),
    (["--set", "stages.recover.input=/no/such/artifact"], "neither an earlier stage nor an existing"),
    (["--set", "stages.recover.config=smollm2_recoverr"], "not a config of train/config_registry.py"),
    (["--set", "stages.qat.steps=0"], "stages[7].steps=0 must be > 0"),
    (["--set", "stages.recover.lr=0"], "stages[4].lr=0.0 must be > 0"),
    (["--set", "stages.recover.kind=distil"], "stages[4].kind 'distil' is not one of"),
    (["--set", "stages.nope.steps=1"], "no stage named 'nope'"),
    (["--set", "data.calibration=wikitext2-test"], "never be calibrated on"),
    (["--set", "data.train=/no/such/data.jsonl"], "data.train: --dataloader.source: path /no/such/data.jsonl does not"),
    (["--set", "data.calibration=/no/such/calib"], "data.calibration: calibration.source: path /no/such/calib"),
    (["--stage", "recoverr"], "is not a stage of"),
    (["--set", "stages.prune.protect=recover"], "stages[2].protect 'recover' is neither an earlier heads stage"),
    (["--set", "stages.report.needle=true"], "stages[10].needle: a report stage is not evaluated"),
    (["--json", "x.json"], "--json needs --dry-run"),
    (["--set", "stages.release.dtype=int8"], "stages[8].dtype 'int8' is not one of"),
    (["--set", "stages.release.sparse_storage=csr"], "stages[8].sparse_storage 'csr' is not one of"),
    (["--set", "stages.verify.kernel_layers=-1"], "stages[9].kernel_layers=-1"),
    (["--set", "stages.prune.calib_forward=fp8"], "stages[2].calib_forward 'fp8' is not one of"),
    (["--set", "stages.quantize.calib_hessian=float16"], "stages[5].calib_hessian 'float16' is not one of"),
    (["--set", "stages.prune.refit=weights"], "stages[2].refit 'weights' is not one of"),
    (["--set", "stages.prune.refit=teacher", "--set", "stages.prune.calib_true_sequential=true"],
     "stages[2]: refit = \"teacher\" needs calib_true_sequential = false"),
    (["--set", "stages.quantize.calib_true_sequential=1"], "stages[5].calib_true_sequential=1 has the wrong type"),
    (["--set", "eval.needle_dtype=fp8"], "eval.needle_dtype 'fp8' is not float32, bfloat16 or auto"),
    (["--set", "stages.prune.skip=attention.wq"], "stages[2].skip='attention.wq' has the wrong type"),
    (["--set", 'stages.prune.skip=["output,attention.wq"]'], "stages[2].skip ['output,attention.wq']: each entry is one module name"),
]


def test_unknown_kind_in_a_file_and_env_budgets(capsys, tmp_path, monkeypatch):
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\nteacher = "smollm2-135m"\nrun_dir = "r"\n[[stages]]\nkind = "distil"\n')
    code, _, err = _cli(capsys, bad, "--dry-run")
    assert code == 2 and "stages[0].kind 'distil' is not one of" in err
    monkeypatch.setenv("SMELT_NPROC", "4")  # a Slurm job's ranks: 4 x local batch 1 does not divide 2
    code, _, err = _cli(capsys, RECIPES / "smollm2-cpu.toml", "--list-stages")
    assert code == 2 and "global_batch=2 is not divisible by local_batch 1 x data-parallel degree 4" in err
    monkeypatch.setenv("SMELT_NPROC", "1")  # gradient accumulation fills the global batch
    assert load(RECIPES / "smollm2-cpu.toml").dp == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.toml"]


def test_set_syntax():
    values = {"stages": [{"kind": "prune"}, {"kind": "recover", "name": "heal", "steps": 5}]}
    for s in ("stages.heal.steps=2", "stages.prune.pattern=2:4", "run_dir=/tmp/x y", "eval.windows={en=2}",
              "parallelism.nproc=3", "stages.prune.evaluate=false"):
        set_value(values, s)
    assert values["stages"] == [{"kind": "prune", "pattern": "2:4", "evaluate": False},
                                {"kind": "recover", "name": "heal", "steps": 2}]
    assert values["run_dir"] == "/tmp/x y" and values["parallelism"] == {"nproc": 3}
    assert values["eval"] == {"windows": {"en": 2}}


def test_registry_read_statically_matches_the_real_configs():
    from train import cpu_shims

    cpu_shims.apply()  # before torchtitan is first imported in this process (as every entry point does)
    import train.config_registry as registry  # tests may import train/; configs/ may not
    from train.run import config_names

    read = read_registry()
    assert sorted(read) == sorted(config_names(registry))
    for name, got in read.items():
        cfg = getattr(registry, name)()
        tr = cfg.training
        want = {"steps": tr.steps, "local_batch": tr.local_batch_size, "seq_len": tr.seq_len,
                "dtype": tr.mixed_precision_param, "source": cfg.dataloader.source,
                "activation_checkpoint": cfg.activation_checkpoint is not None,
                "fake_quant": cfg.model_spec.model.fake_quant.enable}
        if tr.global_batch_size > 0:
            want["global_batch"] = tr.global_batch_size
        if getattr(cfg.model_spec.model, "mtp", None) is not None and cfg.model_spec.model.mtp.fuse_layers:
            want["fuse_layers"] = tuple(cfg.model_spec.model.mtp.fuse_layers)
        assert got == want, name


def test_memory_rows_follow_the_budget():
    from configs.memory import Budget, estimate

    s = Shape(layers=4, d_model=64, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=256, tied=True)
    one = estimate(s, Budget("recover", 2, 32, "float32", 2, "cpu"))
    two = estimate(s, Budget("recover", 4, 32, "float32", 2, "cpu"))
    assert two["activations"] == pytest.approx(2 * one["activations"])
    assert two["parameters"] == one["parameters"]
    sharded = estimate(s, Budget("recover", 2, 32, "float32", 4, "cpu"))
    assert sharded["optimizer"] == pytest.approx(one["optimizer"] / 2)
    ac = estimate(s, Budget("recover", 2, 32, "bfloat16", 2, "gpu", activation_checkpoint=True))
    assert ac["activations"] < estimate(s, Budget("recover", 2, 32, "bfloat16", 2, "gpu"))["activations"]
    qat = estimate(s, Budget("qat", 2, 32, "float32", 2, "cpu", fake_quant=True))
    assert qat["activations"] > one["activations"]


def test_debug_prune_stage_runs_then_skips(capfd, tmp_path, tiny_model_dir):
    run = tmp_path / "run"
    base = [RECIPES / "debug.toml", "--set", f"teacher={tiny_model_dir}", "--set", f"run_dir={run}"]
    argv = [*base, "--stage", "prune", "--set", "stages.prune.evaluate=false"]
    assert _run(*base, "--stage", "heads") == 0, capfd.readouterr().err[-2000:]
    heads = json.loads((run / "heads.json").read_text())
    code = _run(*argv)
    out = capfd.readouterr()
    assert code == 0, out.err[-2000:]
    pruned = run / "pruned-2of4"
    assert {"model.safetensors", "masks.safetensors", "manifest.json"} <= {p.name for p in pruned.iterdir()}
    manifest = json.loads((pruned / "manifest.json").read_text())
    assert manifest["stage"] == "prune" and manifest["settings"]["pattern"] == "2:4"
    # the heads stage's protected set is what the prune stage kept dense
    assert manifest["settings"]["protect"] == str(run / "heads.json")
    dense = load_dense_rows(pruned)
    assert sum(int(v.sum()) for k, v in dense.items() if k.endswith("wq")) == 16 * len(heads["protected"]) > 0
    assert _run(*argv) == 0 and f"skip: {pruned} exists" in capfd.readouterr().out
    assert sorted(p.name for p in run.iterdir()) == ["heads.json", "heads.png", "pruned-2of4"]


def test_a_self_text_stage_runs_skips_and_feeds_an_mtp_stage(capfd, tmp_path, tiny_model_dir):
    """The debug recipe's self-text stage on the tiny teacher: the model's own text, then an MTP stage (one
    rank) trained on it, its manifest naming that file."""
    run = tmp_path / "run"
    base = [RECIPES / "debug.toml", "--set", f"teacher={tiny_model_dir}", "--set", f"run_dir={run}",
            "--set", "parallelism.nproc=1"]
    text = [*base, "--stage", "self-text", "--set", f"stages.self-text.input={tiny_model_dir}"]
    assert _run(*text) == 0, capfd.readouterr().err[-2000:]
    rows = (run / "self-text" / "text.jsonl").read_text().splitlines()
    manifest = json.loads((run / "self-text" / "manifest.json").read_text())
    assert len(rows) == 8 and manifest["stage"] == "self_text" and manifest["settings"]["model"] == str(tiny_model_dir)
    assert manifest["metrics"]["generated_tokens"] == 8 * 48
    assert _run(*text) == 0 and f"skip: {run}/self-text exists" in capfd.readouterr().out
    code = _run(*base, "--stage", "mtp", "--set", f"stages.mtp.input={tiny_model_dir}")
    assert code == 0, capfd.readouterr().err[-3000:]
    trained = json.loads((run / "mtp-2of4" / "manifest.json").read_text())
    assert trained["settings"]["data"]["source"] == str(run / "self-text" / "text.jsonl")
    assert (run / "mtp-2of4" / "mtp.safetensors").is_file()


SELF_TEXT_BAD = [
    (["--set", "stages.mtp.source=prune"], "stages[6].source 'prune' is a prune stage"),
    (["--set", "stages.mtp.source=qat-text"], "stages[6].source 'qat-text' is a later stage"),
    (["--set", "stages.mtp.source=/no/such.jsonl"], "stages[6].source: --dataloader.source: path /no/such.jsonl"),
    (["--set", "stages.mtp.teacher_cache=cache"], "stages[6]: source and teacher_cache together"),
    (["--set", "stages.mtp.source=mtp"], "stages[6].source 'mtp' is this stage"),
    (["--set", "stages.realign.source=verify"], "stages[11].source 'verify' is a later stage"),
    (["--set", "stages.realign.source=heads"], "stages[11].source 'heads' is a heads stage"),
    (["--set", "stages.self-text.out=recovered-2of4"], "stages[5].out: {run}/recovered-2of4 is stage 'recover''s output"),
    (["--set", "stages.self-text.corpus=wikitext2-test"], "stages[5].corpus: training corpus 'wikitext2-test' is not"),
    (["--set", "stages.self-text.prompts=1"], "stages[5].prompts=1 is fewer than the 2 corpora"),
    (["--set", "stages.self-text.temperature=-1.0"], "stages[5].temperature=-1.0 must be >= 0"),
    (["--set", "stages.self-text.corpus=/tmp/text.jsonl"], "stages[5].corpus '/tmp/text.jsonl': prompts come from"),
    (["--set", "stages.self-text.prompt_len=1"], "stages[5].prompt_len=1 must be >= 2 (BOS and at least one"),
    (["--set", "stages.self-text.prompts=0"], "stages[5].prompts=0 must be >= 1"),
    (["--set", "stages.self-text.needle=true"], "stages[5].needle: a self_text stage is not evaluated"),
]


BAD_CASES = [("smollm2-cpu.toml", *case) for case in BAD] + [("debug.toml", *case) for case in SELF_TEXT_BAD]


@pytest.mark.parametrize("recipe,args,message", BAD_CASES, ids=[m for *_, m in BAD_CASES])
def test_bad_input_is_one_line_and_writes_nothing(capsys, tmp_path, recipe, args, message):
    code, out, err = _cli(capsys, RECIPES / recipe, "--dry-run" if "--json" not in args else "",
                          "--set", f"run_dir={tmp_path / 'run'}", *args)
    lines = err.strip().splitlines()
    message = message.replace("{run}", str(tmp_path / "run"))
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], err
    assert out == "" and list(tmp_path.iterdir()) == []


def test_missing_input_is_one_line_at_run_time(capsys, tmp_path, tiny_model_dir):
    run = tmp_path / "run"
    base = [RECIPES / "debug.toml", "--set", f"teacher={tiny_model_dir}", "--set", f"run_dir={run}"]
    code, _, err = _cli(capsys, *base, "--stage", "recover")
    assert code == 2 and f"input {run}/reconstructed-2of4 does not exist" in err and err.count("\n") == 1
    # an MTP stage whose main model exists but whose text (the self-text stage's) was never written
    code, _, err = _cli(capsys, *base, "--stage", "mtp", "--set", f"stages.mtp.input={tiny_model_dir}")
    assert code == 2 and f"input {run}/self-text/text.jsonl does not exist" in err and err.count("\n") == 1
    assert not run.exists()


def _with_cache_stage(tmp_path: Path, **cache) -> Path:
    """smollm2-cpu.toml with a teacher_cache stage before recovery, recovery and QAT reading it."""
    text = (RECIPES / "smollm2-cpu.toml").read_text()
    keys = {"top_k": 64, "windows": 240, "seq_len": 512, "local_batch": 1, "dtype": '"bfloat16"', **cache}
    stage = '[[stages]]\nkind = "teacher_cache"\nname = "teacher-top64"\n' + "".join(
        f"{k} = {v}\n" for k, v in keys.items()) + "\n"
    text = text.replace('[[stages]]\nkind = "recover"', stage + '[[stages]]\nkind = "recover"', 1)
    for config in ("smollm2_recover", "smollm2_qat"):
        text = text.replace(f'config = "{config}"', f'config = "{config}"\nteacher_cache = "teacher-top64"', 1)
    path = tmp_path / "cached.toml"
    path.write_text(text)
    return path


def test_a_teacher_cache_stage_feeds_recovery_and_qat(capsys, tmp_path):
    smol = tmp_path / "smol"
    smol.mkdir()
    (smol / "config.json").write_text(json.dumps(config_to_hf(FLAVORS["smollm2-135m"])))
    run = tmp_path / "run"
    _, plan = _dry_run(capsys, _with_cache_stage(tmp_path), tmp_path, "--set", f"run_dir={run}",
                       "--teacher-config", str(smol))
    stages = {s["name"]: s for s in plan["stages"]}
    assert stages["teacher-top64"]["commands"] == [
        f"python -m distill.teacher_cache --teacher smollm2-135m --source {MIX} --seq-len 512 --windows 240 "
        f"--top-k 64 --ranks 1 --local-batch 1 --dtype bfloat16 --out {run}/teacher-top64"]
    assert stages["teacher-top64"]["evaluation"] is None
    for name in ("recover", "qat"):
        assert stages[name]["commands"][0].endswith(f"--dataloader.teacher_cache {run}/teacher-top64"), name
        assert stages[name]["memory_gib"]["teacher"] < 0.05  # its batch of top-k, no teacher model
    plain = {s["name"]: s for s in _dry_run(capsys, RECIPES / "smollm2-cpu.toml", tmp_path,
                                            "--teacher-config", str(smol))[1]["stages"]}
    assert plain["recover"]["memory_gib"]["teacher"] > 0.1
    assert plain["recover"]["memory_gib"]["total"] > stages["recover"]["memory_gib"]["total"]
    for cache, message in (({"seq_len": 256}, "teacher_cache 'teacher-top64' holds seq_len 256; this stage "
                                              "trains with 512"),
                           ({"top_k": 0}, "stages[4].top_k=0 must be >= 1"),
                           ({"dtype": '"float16"'}, "stages[4].dtype 'float16' is not float32 or bfloat16")):
        code, out, err = _cli(capsys, _with_cache_stage(tmp_path, **cache), "--dry-run")
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    code, _, err = _cli(capsys, _with_cache_stage(tmp_path), "--dry-run", "--set",
                        "stages.recover.teacher_cache=prune")
    assert code == 2 and "stages[5].teacher_cache 'prune' is not an earlier teacher_cache stage" in err
