"""docs/cli.md, the command-line reference, written from the commands' own argparse parsers.

    smelt cli-doc              # rewrite docs/cli.md          (or: python -m smelt.cli_doc)
    smelt cli-doc --check      # exit 1 if docs/cli.md is not what the parsers give now (the tests run this)
"""
from __future__ import annotations

import argparse
import ast
import os
import sys
from contextlib import contextmanager
from pathlib import Path

from core.errors import ArgumentParser, run_cli
from core.files import atomic_write_text
from smelt.cli import COMMANDS, Command, overview, parser_of

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "cli.md"
PACKAGES = ("core", "configs", "models", "prune", "distill", "qat", "eval", "kernels", "train", "smelt")
WIDTH = "100"  # argparse wraps usage to the terminal: fixed here so the page does not depend on who ran it


@contextmanager
def fixed_width():
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def options_table(parser: argparse.ArgumentParser) -> list[str]:
    formatter = parser._get_formatter()
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        if action.option_strings:
            name = ", ".join(action.option_strings)
            if action.nargs != 0:
                name += " " + formatter._format_args(action, formatter._get_default_metavar_for_optional(action))
        else:
            name = formatter._format_args(action, formatter._get_default_metavar_for_positional(action))
        name = f"`{name}`"
        default = action.default
        hidden = default in (None, False, "", argparse.SUPPRESS) or default == [] or action.nargs == 0
        shown = "" if hidden else f"`{default}`"
        if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
            shown += (" " if shown else "") + "one of " + ", ".join(f"`{c}`" for c in action.choices)
        text = formatter._expand_help(action) if action.help else ""
        rows.append(f"| {name} | {_cell(shown)} | {_cell(text)} |")
    if not rows:
        return []
    return ["| argument | default | what it sets |", "|---|---|---|", *rows]


def module_doc(module: str) -> str:
    """The first paragraph of a module's docstring, on one line (read from its source: nothing is imported)."""
    path = ROOT / Path(*module.split(".")).with_suffix(".py")
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    return " ".join(doc.split("\n\n")[0].split())


def section(command: Command) -> list[str]:
    parser = parser_of(command)
    lines = [f"## smelt {command.name}", "", f"{command.summary[0].upper()}{command.summary[1:]}. "
             f"Runs `python -m {command.module}`" + (f" with `{' '.join(command.prefix)}`" if command.prefix else "")
             + "." + (" RECIPE is a file or the name of one in `configs/recipes/`." if command.recipe else ""), ""]
    about = module_doc(command.module)
    if about:
        lines += [about, ""]
    lines += ["```", parser.format_usage().strip(), "```", ""]
    return lines + options_table(parser) + [""]


def other_entry_points() -> list[tuple[str, str]]:
    """(module, first docstring line) of every `python -m` entry point that is no `smelt` subcommand."""
    covered = {c.module for c in COMMANDS.values()} | {"smelt.cli", "smelt.__main__"}
    out = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).glob("*.py")):
            module = f"{package}.{path.stem}"
            source = path.read_text(encoding="utf-8")
            if module in covered or '__name__ == "__main__"' not in source:
                continue
            out.append((module, module_doc(module)))
    return out


INTRO = ("Written by `smelt cli-doc` from the commands' own argparse parsers; `smelt cli-doc --check` (a test) "
         "fails when this page is stale. Every `smelt SUB` is also `python -m MODULE` with the same arguments; "
         "`smelt SUB --help` prints what is below. Bad input is one line, `error: ...`, exit status 2 "
         "(`SMELT_TRACEBACK=1` shows the traceback).")
OTHERS = ("Modules run with `python -m` that are no `smelt` command: benchmarks, the training ranks' entry point "
          "(`smelt train` starts it under torchrun), data fetches, the generators of docs pages.")


def render() -> str:
    with fixed_width():
        lines = ["# Command-line reference", "", INTRO, "", "```", overview(), "```", "",
                 "| command | runs | what it does |", "|---|---|---|"]
        lines += [f"| [`smelt {c.name}`](#smelt-{c.name}) | `python -m {c.module}` | {_cell(c.summary)} |"
                  for c in COMMANDS.values()]
        lines.append("")
        for command in COMMANDS.values():
            lines += section(command)
    lines += ["## Other entry points", "", OTHERS, "", "| module | what it is |", "|---|---|"]
    lines += [f"| `python -m {m}` | {_cell(doc)} |" for m, doc in other_entry_points()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m smelt.cli_doc", description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="only compare: exit 1 when the page differs")
    ap.add_argument("--out", type=Path, help="the page to write or check (default: the repository's docs/cli.md)")
    args = ap.parse_args(argv)
    args.out = args.out or DOC
    text = render()
    current = args.out.read_text(encoding="utf-8") if args.out.is_file() else None
    if args.check:
        if current != text:
            print(f"{args.out} is stale: run `smelt cli-doc` and commit it", file=sys.stderr)
            return 1
        print(f"{args.out} is current")
        return 0
    if current != text:
        atomic_write_text(args.out, text)
    print(f"wrote {args.out}" if current != text else f"{args.out} is current")
    return 0


if __name__ == "__main__":
    run_cli(main)
