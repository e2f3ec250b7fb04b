"""The recipes this repository ships (configs/recipes/*.toml): name, file, what each is, the hardware it is sized
for and its measured wall time, from the recipe files' own `description`, `hardware` and `measured` keys.

    smelt recipes            # a table
    smelt recipes --json     # the same as JSON
"""
from __future__ import annotations

import json
from pathlib import Path

from configs.recipe_spec import catalog
from core.errors import ArgumentParser, run_cli


def shown(path: Path) -> str:
    """A path as a user would type it here: relative below the working directory, else absolute."""
    path = path.resolve()
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)


def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(prog="python -m smelt.recipes", description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print the list as JSON")
    args = ap.parse_args(argv)
    rows = catalog()
    if args.json:
        print(json.dumps([{**r._asdict(), "path": shown(r.path)} for r in rows], indent=1))
        return
    for r in rows:
        print(f"{r.path.stem}   ({shown(r.path)})\n    {r.description}\n"
              f"    hardware: {r.hardware}\n    measured: {r.measured}\n")
    print("smelt plan NAME: its stages, commands and memory; smelt run NAME: run it")


if __name__ == "__main__":
    run_cli(main)
