"""Recipe files that build on another (`extends`, [set], stages inserted `after` one), the catalogue keys and
`catalog` (what `smelt recipes` lists), and the smoke preset's plan against the default's."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import ROOT
from test_recipe import _cli, _dry_run

from configs.recipe_spec import RECIPES, catalog, load, read_values
from core.errors import SmeltError
from models.hf_io import config_to_hf
from models.llama import FLAVORS

BASE = '''name = "base"
description = "a base"
hardware = "a CPU"
measured = "not run yet"
teacher = "smollm2-135m"
run_dir = "runs/base"
[eval]
windows = { en = 16, zh = 8 }
[[stages]]
kind = "teacher"
[[stages]]
kind = "prune"
pattern = "2:4"
calib_windows = 64
[[stages]]
kind = "recover"
config = "smollm2_recover"
steps = 30
[[stages]]
kind = "release"
'''


@pytest.fixture(autouse=True)
def _at_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # the 8B recipe's teacher_config is relative to the repository root


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _child(tmp_path: Path, body: str, head: str = 'extends = "base.toml"\nname = "child"\nrun_dir = "runs/child"\n'):
    _write(tmp_path, "base.toml", BASE)
    return _write(tmp_path, "child.toml", head + body)


def test_a_recipe_extends_another_inserts_stages_and_sets_values(tmp_path):
    child = _child(tmp_path, '''hardware = "a bigger CPU"
[set]
stages.prune.calib_windows = 6
"stages.recover.steps" = 2
eval.windows = { en = 2 }
[[stages]]
after = "recover"
kind = "ptq"
name = "quantize"
[[stages]]
kind = "qat"
config = "smollm2_qat"
steps = 3
[[stages]]
after = "teacher"
kind = "heads"
[[stages]]
after = "release"
kind = "verify"
''')
    recipe = load(child)
    assert [s.name for s in recipe.stages] == ["teacher", "heads", "prune", "recover", "quantize", "qat", "release",
                                               "verify"]
    stages = {s.name: s for s in recipe.stages}
    assert stages["prune"].calib_windows == 6 and stages["recover"].steps == 2 and stages["qat"].steps == 3
    assert recipe.eval == {"windows": {"en": 2, "zh": 8}}  # a table under [set] merges key by key
    assert (recipe.name, recipe.run_dir, recipe.hardware) == ("child", "runs/child", "a bigger CPU")
    assert recipe.description is None and recipe.measured is None  # the base's describe the base
    assert stages["quantize"].src.endswith("runs/child/recover") and stages["release"].src.endswith("runs/child/qat")
    # --set applies after the file, to inserted stages too; a recipe may extend one that extends another
    assert load(child, ["stages.qat.steps=5"]).stages[5].steps == 5
    grandchild = _write(tmp_path, "grandchild.toml", 'extends = "child.toml"\nname = "g"\nrun_dir = "runs/g"\n'
                                                     '[set]\nstages.qat.steps = 7\n[[stages]]\nkind = "report"\n')
    chain = [(s.name, getattr(s, "steps", None)) for s in load(grandchild).stages]
    assert chain[5] == ("qat", 7) and chain[-1] == ("report", None)  # no `after` in a file's first table: the end
    assert load(tmp_path / "base.toml").stages[1].calib_windows == 64  # the base file is unchanged


BAD_FILES = [
    ('extends = "base.toml"\nname = "c"\n', "child.toml: a recipe that extends another sets its own run_dir"),
    ('extends = "base.toml"\nrun_dir = "r"\n', "child.toml: a recipe that extends another sets its own name"),
    ('extends = "nope.toml"\nname = "c"\nrun_dir = "r"\n', "recipe {tmp}/nope.toml does not exist"),
    ('extends = "child.toml"\nname = "c"\nrun_dir = "r"\n', "extends 'child.toml' is a cycle"),
    ('extends = 3\nname = "c"\nrun_dir = "r"\n', "extends = 3 must be a recipe file"),
    ('extends = "base.toml"\nname = "c"\nrun_dir = "r"\nteacher = "x"\n',
     "'teacher' is not a key of a recipe that extends another"),
    ('extends = "base.toml"\nname = "c"\nrun_dir = "r"\n[[stages]]\nafter = "qat"\nkind = "verify"\n',
     "child.toml: stages[0].after 'qat' is not a stage of the chain (teacher, prune, recover, release)"),
    ('extends = "base.toml"\nname = "c"\nrun_dir = "r"\n[set]\nstages.qat.steps = 2\n',
     "child.toml: set.stages.qat.steps: no stage named 'qat'"),
    ('extends = "base.toml"\nname = "c"\nrun_dir = "r"\n[set]\nstages.recover.stepz = 2\n',
     "unknown config key 'stages[2].stepz'"),
    ('extends = "base.toml"\nname = "c"\nrun_dir = "r"\n[set]\nstages.recover.steps = "many"\n',
     "config stages[2].steps='many' has the wrong type"),
    ('extends = "base.toml"\nname = "c"\nrun_dir = "r"\nset = 3\n', "set must be a table of KEY = VALUE"),
    ('extends = "base.toml"\nname = "c"\nrun_dir = "r"\n[[stages]]\nafter = "recover"\nkind = "recover"\n'
     'config = "smollm2_recover"\nsteps = 1\n', "stages[3].name 'recover': names are unique"),
    ('name = "c"\nteacher = "t"\nrun_dir = "r"\n[set]\nx = 1\n', "child.toml: [set] changes a base recipe's values"),
    ('name = "c"\nteacher = "t"\nrun_dir = "r"\n[[stages]]\nafter = "teacher"\nkind = "teacher"\n',
     "unknown config key 'stages[0].after'"),
    ('extends = "base.toml"\nname = "c"\nrun_dir = "r"\ndescription = "two\\nlines"\n',
     "description = 'two\\nlines': one line of text is required"),
    ('extends = "base.toml"\nname = "c"\nrun_dir = "r"\nstages = 3\n', "child.toml: stages must be [[stages]] tables"),
]


@pytest.mark.parametrize("text,message", BAD_FILES, ids=[m for _, m in BAD_FILES])
def test_a_bad_extending_file_is_one_line_and_writes_nothing(capsys, tmp_path, text, message):
    _write(tmp_path, "base.toml", BASE)
    child = _write(tmp_path, "child.toml", text)
    code, out, err = _cli(capsys, child, "--dry-run")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:"), err
    assert message.replace("{tmp}", str(tmp_path)) in lines[0], err
    assert out == "" and sorted(p.name for p in tmp_path.iterdir()) == ["base.toml", "child.toml"]


def test_every_shipped_recipe_is_catalogued_and_loads():
    """configs/recipes/: each file's name is its file name (what `smelt run NAME` finds), its three catalogue keys
    are one line each, and the whole recipe loads and checks."""
    entries = catalog()
    assert [e.path.name for e in entries] == sorted(p.name for p in RECIPES.glob("*.toml"))
    assert {"smollm2-cpu", "smollm2-cpu-mtp", "smollm2-cpu-smoke", "debug", "llama3.1-8b-h100"} <= {
        e.name for e in entries}
    for e in entries:
        assert e.name == e.path.stem, e.path
        for value in (e.description, e.hardware, e.measured):
            assert value.strip() and "\n" not in value, e.path
        assert load(e.path).name == e.name
    default = next(e for e in entries if e.name == "smollm2-cpu")
    assert re.search(r"\d+ min .*2-core", default.measured), default.measured


def test_recipe_files_say_what_values_do_not_their_history():
    """Comments explain; the history of a value lives in docs/defaults history, not in the file."""
    for path in RECIPES.glob("*.toml"):
        text = path.read_text()
        for pattern in (r"\bissue \d+", r"\bstop\b", r"\bsince 20\d\d", r"\b20\d\d-\d\d-\d\d\b", r"README, "):
            assert not re.search(pattern, text, re.IGNORECASE), (path.name, pattern)
        kinds = {s["kind"] for s in read_values(path)["stages"]}
        header = text.split("\nname = ", 1)[0] if "extends" not in text else text.split("\nextends = ", 1)[0]
        assert "->" in header, path.name  # the header draws the chain ...
        for kind in kinds & {"reconstruct", "qreconstruct", "self_text", "mtp"}:  # ... with these stage kinds
            assert kind.replace("self_text", "self text").replace("mtp", "MTP") in header, (path.name, kind)


def test_catalog_refuses_a_recipe_without_its_keys(tmp_path):
    _write(tmp_path, "base.toml", BASE)
    assert [tuple(e)[:1] + tuple(e)[2:] for e in catalog(tmp_path)] == [("base", "a base", "a CPU", "not run yet")]
    _write(tmp_path, "child.toml", 'extends = "base.toml"\nname = "child"\nrun_dir = "r"\n')
    with pytest.raises(SmeltError, match=r"child.toml: description is missing"):
        catalog(tmp_path)  # the base's description is not the child's


def test_smoke_preset_is_the_default_chain_with_tiny_budgets(capsys, tmp_path):
    """The smoke preset's plan: the default's stages and commands, only its budgets and run_dir changed."""
    smol = tmp_path / "smollm2-config"
    smol.mkdir()
    (smol / "config.json").write_text(json.dumps(config_to_hf(FLAVORS["smollm2-135m"])))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    _, default = _dry_run(capsys, RECIPES / "smollm2-cpu.toml", tmp_path / "a", "--teacher-config", smol,
                          "--set", "run_dir=runs/smoke")
    _, smoke = _dry_run(capsys, RECIPES / "smollm2-cpu-smoke.toml", tmp_path / "b", "--teacher-config", smol)
    assert smoke["run_dir"] == "runs/smoke" and smoke["recipe"] == "smollm2-cpu-smoke"
    base, stages = {s["name"]: s for s in default["stages"]}, {s["name"]: s for s in smoke["stages"]}
    assert list(stages) == list(base)
    # budgets: windows, epochs, steps, the needle probes and the refit (the smoke's only change of method, for time)
    budget = re.compile(r"--(calib-windows|epochs|training\.steps|windows|needle-lengths|needle-samples|refit) \S+"
                        r"|--needle ")
    def strip(command):
        return command if command is None else " ".join(budget.sub("", command).split())

    unevaluated = {"prune", "reconstruct", "recover", "quantize", "qreconstruct"}
    for name, want in base.items():
        assert [strip(c) for c in want["commands"]] == [strip(c) for c in stages[name]["commands"]], name
        if name in unevaluated:  # run, not evaluated: only the teacher and the release's model are
            assert want["evaluation"] and stages[name]["evaluation"] is None, name
        else:
            assert strip(want["evaluation"]) == strip(stages[name]["evaluation"]), name
    assert stages["recover"]["tokens"] == 1 * 2 * 512 and stages["qat"]["tokens"] == 1 * 2 * 512
    assert stages["prune"]["tokens"] == 3 * 512 and stages["quantize"]["tokens"] == 3 * 512
    assert all("--needle " not in (s["evaluation"] or "") for s in smoke["stages"])
