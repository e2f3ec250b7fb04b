"""The house rules: a bare export of the committed tree runs on its own, and folders import only the
floors below them (DEVELOPERS.md, "Layout")."""
from __future__ import annotations

import ast
import glob
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

from conftest import ROOT

# Which project packages each folder may import. `core` is the ground floor; `configs` and `models` sit
# directly on it; stages stand side by side; `train` may use the losses and fake quantization it trains;
# nothing imports `train`. `smelt` (the console command) is the top floor: it may import every package and
# nothing imports it.
FLOORS = {"core", "configs", "models"}
PACKAGES = {"core", "configs", "models", "prune", "distill", "qat", "eval", "kernels", "train", "smelt"}
ALLOWED = {
    "core": {"core"},
    "configs": {"core", "configs"},
    "models": {"core", "models"},
    "prune": FLOORS | {"prune"},
    "distill": FLOORS | {"distill"},
    "qat": FLOORS | {"qat"},
    "eval": FLOORS | {"eval"},
    "kernels": FLOORS | {"kernels"},
    "train": FLOORS | {"distill", "qat", "train"},
    "smelt": PACKAGES,
}
USER_SCRIPTS = ["constraints.txt", "env.sh", "fsdp_smoke.sh", "gpu_smoke.sh", "recipe.sh", "test.sh"]  # what users run


def project_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of a project package in a source file, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [(node.lineno, n) for n in names if n.split(".")[0] in ALLOWED]
    return found


def layer_violations(root: Path) -> list[str]:
    bad = []
    for folder, allowed in ALLOWED.items():
        for path in sorted((root / folder).rglob("*.py")):
            for line, module in project_imports(path):
                if module.split(".")[0] not in allowed:
                    bad.append(f"{path.relative_to(root)}:{line} imports {module} "
                               f"({folder}/ may import only {', '.join(sorted(allowed))})")
    return bad


def test_folders_import_only_the_floors_below_them():
    assert layer_violations(ROOT) == []


def test_scripts_holds_only_user_tools_and_every_experiment_has_its_paragraph():
    assert sorted(p.name for p in (ROOT / "scripts").iterdir()) == USER_SCRIPTS
    readme = (ROOT / "experiments" / "README.md").read_text(encoding="utf-8")
    experiments = sorted(p.name for p in (ROOT / "experiments").iterdir() if p.name != "README.md")
    assert experiments and [name for name in experiments if f"**`{name}`**" not in readme] == []
    cited = {m.rstrip(".,") for m in re.findall(r"results/[\w./*-]+", readme)}  # what each one wrote
    missing = [c for c in sorted(cited) if not (glob.glob(str(ROOT / c)) or (ROOT / f"{c}.json").is_file())]
    assert missing == [], "experiments/README.md cites results that are not in the repository"


def test_the_layer_check_names_a_forbidden_import(tmp_path):
    for folder in ALLOWED:
        (tmp_path / folder).mkdir()
    (tmp_path / "eval" / "bad.py").write_text("import os\n\nfrom train.trainer import SmeltTrainer\n")
    (tmp_path / "core" / "worse.py").write_text("def f():\n    from prune import algorithms\n")
    (tmp_path / "qat" / "cmd.py").write_text("from smelt.cli import COMMANDS\n")  # nothing imports the command
    (tmp_path / "smelt" / "top.py").write_text("import train.launch\nfrom qat import release\n")  # it imports all
    assert layer_violations(tmp_path) == [
        "core/worse.py:2 imports prune (core/ may import only core)",
        "qat/cmd.py:1 imports smelt.cli (qat/ may import only configs, core, models, qat)",
        "eval/bad.py:3 imports train.trainer (eval/ may import only configs, core, eval, models)",
    ]


SMOKE = textwrap.dedent("""
    import json, subprocess, sys
    from pathlib import Path

    here = Path.cwd().resolve()
    sys.path.insert(0, str(here / "tests"))
    from conftest import make_byte_tokenizer, tiny_config
    import core.data as data
    from models.hf_io import save_hf
    from models.llama import build_model

    assert Path(data.__file__).resolve().is_relative_to(here), data.__file__
    assert data.data_dir().resolve() == here / "data", data.data_dir()
    for name in ("wikitext2-valid", "wikitext2-test", "zh", "code", "code-train"):
        assert len(data.read_corpus(name)) > 10_000, name

    tiny = here / "tiny"
    tiny.mkdir()
    save_hf(build_model(tiny_config(max_seq_len=64), seed=1), tiny, tokenizer=make_byte_tokenizer())
    subprocess.run([sys.executable, "-m", "eval.evaluate", "--teacher", str(tiny), "--model", str(tiny),
                    "--windows", "en=1,zh=1,code=1", "--seq-len", "32", "--out", "eval.json"], check=True)
    report = json.loads(Path("eval.json").read_text())
    assert set(report["buckets"]) == {"en", "zh", "code"}
    print("SMOKE OK", report["buckets"]["en"]["tokens"])
""")


def test_a_bare_export_of_the_committed_tree_loads_data_and_evaluates(tmp_path):
    """`git archive` of HEAD into an empty directory, run there with no SMELT_* variables: the clone has
    its own text and needs nothing beside it (the cache goes to a fresh HOME)."""
    archive = subprocess.run(["git", "archive", "--format=tar", "HEAD"], cwd=ROOT, capture_output=True,
                             check=True).stdout
    export = tmp_path / "smelt"
    export.mkdir()
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(export, filter="data")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SMELT_")}
    env.update(HOME=str(tmp_path / "home"), PYTHONPATH="")
    proc = subprocess.run([sys.executable, "-c", SMOKE], cwd=export, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SMOKE OK 31" in proc.stdout
    rec = json.loads((export / "eval.json").read_text())["settings"]["corpora"]
    assert rec["en"]["file"] == "wikitext2/test.txt" and rec["code"]["files"][0].startswith("code/python311/")


def test_vendored_text_matches_the_hashes_in_its_readme():
    rows = [line.split("|") for line in (ROOT / "data" / "README.md").read_text().splitlines()
            if line.startswith("| `") and len(line.split("|")) == 4]
    assert len(rows) == 23  # 3 text files + 20 Python modules
    for _, name, digest, _ in rows:
        path = ROOT / "data" / name.strip().strip("`")
        assert hashlib.sha256(path.read_bytes()).hexdigest() == digest.strip().strip("`"), path
