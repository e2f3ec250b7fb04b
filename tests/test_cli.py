"""The `smelt` command: its list, every subcommand's own help under its name, real dispatch (a recipe by name,
`smelt compare` on two runs), one-line errors, the generated CLI reference, and the console script itself."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import venv
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from conftest import ROOT

from configs import recipe
from core.errors import SmeltError
from eval import compare
from smelt import cli, cli_doc
from smelt.cli import COMMANDS

CURRENT = ROOT / "results" / "current"  # the default chain's committed evaluations
HELP_ALL = """
import contextlib, io, json, sys
from smelt.cli import COMMANDS, run
out = {}
for name in COMMANDS:
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            run([name, "--help"])
        code = 0
    except SystemExit as e:
        code = e.code or 0
    out[name] = [code, buf.getvalue()]
print(json.dumps(out))
"""


def smelt(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "smelt", *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          check=False, timeout=600)


def test_help_lists_every_subcommand_one_line_each():
    r = smelt("--help")
    assert r.returncode == 0, r.stderr
    listed = [line.split()[0] for line in r.stdout.splitlines() if line.startswith("  ")]
    assert listed == list(COMMANDS)
    for name in ("recipes", "plan", "run", "eval", "compare", "release", "verify", "report"):
        assert name in listed
    assert not r.stderr


def test_every_subcommand_prints_its_own_help_under_its_smelt_name():
    r = subprocess.run([sys.executable, "-c", HELP_ALL], cwd=ROOT, capture_output=True, text=True, check=False,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    helps = json.loads(r.stdout.splitlines()[-1])
    assert set(helps) == set(COMMANDS)
    for name, (code, text) in helps.items():
        assert code == 0, (name, text)
        assert text.startswith(f"usage: smelt {name} "), (name, text[:200])
        assert "python -m" not in text.split("\n")[0], name  # the module's own name never shows as the program
    assert "--stage" in helps["run"][1] and "--windows" in helps["eval"][1]  # each module's own options


def test_plan_by_name_is_the_dry_run_of_the_recipe_file(tmp_path, capsys):
    run_dir = tmp_path / "run"
    cli.run(["plan", "debug", "--set", f"run_dir={run_dir}"])
    by_name = capsys.readouterr().out
    recipe.main(["configs/recipes/debug.toml", "--dry-run", "--set", f"run_dir={run_dir}"])
    assert by_name == capsys.readouterr().out and "stages" in by_name
    assert not run_dir.exists()  # a plan writes nothing
    # an option's value before the recipe is not taken for the recipe
    cli.run(["run", "--set", f"run_dir={run_dir}", "debug", "--list-stages"])
    stages = capsys.readouterr().out.split()
    assert stages[0] == "teacher" and "release" in stages


@pytest.mark.parametrize("args, text", [
    (["evall"], "unknown command 'evall'; did you mean `smelt eval`?"),
    (["eval", "--bogus"], "smelt eval: unrecognized arguments: --bogus"),
    (["plan", "no-such-recipe"], "recipe 'no-such-recipe': no such file"),
    (["compare", "results/current"], "runs: give at least two runs to compare"),
])
def test_errors_are_one_line(args, text, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and text in err, err
    assert len(err.strip().splitlines()) == 1, err


def _evaluation(stage: str) -> dict:
    return json.loads((CURRENT / f"{stage}.json").read_text())


def test_compare_two_runs_per_stage_and_bucket(tmp_path):
    # run A: a recipe run directory (evals/); run B: a folder of evaluation JSONs, its release 10% worse in KL
    a, b = tmp_path / "a", tmp_path / "b"
    (a / "evals").mkdir(parents=True)
    b.mkdir()
    for stage in ("teacher", "pruned-2of4", "qat-2of4"):
        shutil.copy(CURRENT / f"{stage}.json", a / "evals" / f"{stage}.json")
    shutil.copy(CURRENT / "teacher.json", b / "teacher.json")
    shutil.copy(CURRENT / "qat-2of4.manifest.json", b / "qat-2of4.manifest.json")  # not an evaluation: skipped
    worse = _evaluation("qat-2of4")
    for m in worse["buckets"].values():
        m["kl_mean"] *= 1.1
    (b / "qat-2of4.json").write_text(json.dumps(worse))
    r = smelt("compare", a, f"worse={b}", "--json", tmp_path / "c.json", "--plot", tmp_path / "c.png")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("A: a\nB: worse\n")
    got = json.loads((tmp_path / "c.json").read_text())
    assert got["runs"] == ["a", "worse"] and list(got["stages"]) == ["teacher", "pruned-2of4", "qat-2of4"]
    release = _evaluation("qat-2of4")["buckets"]
    for bucket, m in release.items():
        row = got["stages"]["qat-2of4"][bucket]
        assert row["kl_mean"]["values"] == [m["kl_mean"], pytest.approx(1.1 * m["kl_mean"])]
        assert row["kl_mean"]["delta"] == [pytest.approx(0.1 * m["kl_mean"])]
        assert row["kl_p99"]["delta"] == [0.0] and row["ppl"]["values"] == [m["ppl"], m["ppl"]]
    assert got["stages"]["pruned-2of4"]["en"]["kl_mean"]["values"][1] is None  # B has no such stage
    en = next(line for line in r.stdout.splitlines() if line.startswith("| qat-2of4 | en |"))
    assert f"{release['en']['kl_mean']:.3f} | {1.1 * release['en']['kl_mean']:.3f} | " \
           f"+{0.1 * release['en']['kl_mean']:.3f} |" in en
    assert "| pruned-2of4 | en | " in r.stdout and " – " in r.stdout
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(SmeltError, match=f"runs: {tmp_path / 'missing'} is not a directory"):
        compare.main([str(a), str(tmp_path / "missing")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(SmeltError, match="has no evals/ folder and no evaluation reports"):
        compare.main([str(a), str(tmp_path / "empty")])
    with pytest.raises(SmeltError, match="two runs are labelled 'x'"):
        compare.main([f"x={a}", f"x={b}"])


def test_recipes_lists_every_recipe_file(capsys):
    cli.run(["recipes", "--json"])
    listed = json.loads(capsys.readouterr().out)
    assert sorted(Path(x["path"]).name for x in listed) == sorted(p.name for p in (ROOT / "configs" / "recipes")
                                                                  .glob("*.toml"))
    assert all(x["description"] and x["hardware"] and x["measured"] for x in listed)


def test_the_cli_reference_is_current(tmp_path, monkeypatch):
    r = subprocess.run([sys.executable, "-m", "smelt.cli_doc", "--check"], cwd=ROOT, capture_output=True,
                       text=True, check=False, timeout=600)
    assert r.returncode == 0, r.stderr + " (run `smelt cli-doc` and commit docs/cli.md)"
    page = (ROOT / "docs" / "cli.md").read_text()
    for name in COMMANDS:
        assert f"\n## smelt {name}\n" in page
    # --check against a page that differs from what the parsers give: exit 1, the page left as it was
    monkeypatch.setattr(cli_doc, "render", lambda: page)
    stale = tmp_path / "cli.md"
    stale.write_text(page.replace("| `--windows", "| `--old-windows", 1))
    assert cli_doc.main(["--check", "--out", str(stale)]) == 1
    assert cli_doc.main(["--out", str(stale)]) == 0 and stale.read_text() == page
    assert cli_doc.main(["--check", "--out", str(stale)]) == 0


def test_the_console_script_is_declared_and_installs_into_a_fresh_venv(tmp_path):
    (script,) = entry_points(group="console_scripts", name="smelt")
    assert script.value == "smelt.cli:main"
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    py = env_dir / "bin" / "python"
    # the project's dependencies (and pip, setuptools) from this environment; smelt itself installed afresh
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e",
                              str(ROOT)], capture_output=True, text=True, check=False, timeout=600)
    assert install.returncode == 0, install.stderr[-3000:]
    for args in (["--help"], ["eval", "--help"], ["compare", "--help"]):
        r = subprocess.run([str(env_dir / "bin" / "smelt"), *args], cwd=tmp_path, capture_output=True, text=True,
                           check=False, timeout=600)
        assert r.returncode == 0 and r.stdout.startswith("usage: smelt"), (args, r.stderr[-2000:])
