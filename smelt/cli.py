"""`smelt`: one command for every stage and tool of the chain. Each subcommand runs an existing module's main()
(`smelt eval ...` is `python -m eval.evaluate ...`), imported only when it runs so that `smelt --help` is fast.

    smelt --help                 # every subcommand, one line each
    smelt SUB --help             # that module's own options, under the name `smelt SUB`
    smelt plan smollm2-cpu       # a recipe by name (configs/recipes/NAME.toml) or by path

Errors are one line (`error: ...`, exit status 2) as with `python -m`; SMELT_TRACEBACK=1 shows the traceback.
"""
from __future__ import annotations

import argparse
import difflib
import importlib
import inspect
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from core.errors import SmeltError, run_cli


@dataclass(frozen=True)
class Command:
    name: str
    module: str  # whose main() runs
    summary: str  # the line in `smelt --help`
    section: str
    prefix: tuple[str, ...] = ()  # arguments put before the user's (e.g. `plan` adds --dry-run)
    recipe: bool = False  # the first positional argument is a recipe: a name from configs/recipes/ resolves


RUN, STAGES, MEASURE, ANALYSE, PROJECT = ("Run a recipe", "Stages, one at a time", "Measure a model",
                                          "Analyse and compare results", "The project")
COMMANDS = {c.name: c for c in [
    Command("recipes", "smelt.recipes", "the recipes this repository ships: what each is, its hardware, its "
            "measured wall time", RUN),
    Command("plan", "configs.recipe", "check a recipe and print its plan (stages, commands, tokens, memory per "
            "rank); runs nothing", RUN, prefix=("--dry-run",), recipe=True),
    Command("run", "configs.recipe", "run a recipe's stages (or --stage S), each evaluated; finished ones are "
            "skipped; --set KEY=VALUE", RUN, recipe=True),
    Command("prefetch", "smelt.prefetch", "on a login node: fetch all a recipe would download (teacher, corpora, "
            "hf: datasets); jobs run offline", RUN, recipe=True),
    Command("teacher", "models.teacher", "fetch a registered teacher (or import a GGUF) and print its HF "
            "directory", STAGES),
    Command("heads", "prune.heads", "score attention heads (sink, retrieval, importance) and MLP channels; pick "
            "the protected heads", STAGES),
    Command("prune", "prune.run", "one-shot pruning (magnitude, Wanda, SparseGPT; unstructured or N:M) into a "
            "pruned artifact", STAGES),
    Command("depth", "prune.depth", "remove whole blocks by their scores, keeping the blocks that hold "
            "protected heads", STAGES),
    Command("width", "prune.width", "remove attention heads and MLP channels by importance: a smaller dense "
            "model", STAGES),
    Command("reconstruct", "prune.reconstruct", "fit a pruned artifact's MLPs on their kept weights to the "
            "teacher's blocks", STAGES),
    Command("teacher-cache", "distill.teacher_cache", "cache the teacher's top-k log-probs over the training "
            "windows for distillation", STAGES),
    Command("self-text", "distill.self_text", "the model's own continuations of training prompts (text for "
            "its MTP modules)", STAGES),
    Command("train", "train.launch", "start a training stage (KD recovery, QAT, MTP) under torchrun after "
            "checking its config", STAGES),
    Command("export", "train.export", "a saved training step (DCP checkpoint) -> the artifact the live export "
            "writes, without the launcher or a GPU", STAGES),
    Command("ptq", "qat.ptq", "RTN or GPTQ weight quantization into a quantized artifact", STAGES),
    Command("qreconstruct", "qat.reconstruct", "fit a quantized artifact's MLPs on their grid (scales learned) "
            "to the teacher's blocks", STAGES),
    Command("release", "qat.release", "export a quantized artifact as a compressed-tensors release "
            "directory", STAGES),
    Command("verify", "qat.verify", "check a release directory before serving: files, hashes, decompression, "
            "its recorded figures", STAGES),
    Command("eval", "eval.evaluate", "evaluate a model against its teacher: KL mean / P99, top-1, PPL per "
            "bucket", MEASURE),
    Command("needle", "eval.needle", "needle-in-a-haystack retrieval per context length and depth", MEASURE),
    Command("speculative", "eval.speculative", "self-speculative decoding with the MTP modules: acceptance and "
            "tokens/s", MEASURE),
    Command("kernels-check", "kernels.check", "run a release through the Triton kernels and compare with the "
            "reference (GPU)", MEASURE),
    Command("kernels-inspect", "kernels.inspect", "compile the Triton kernels for an H100 offline and read them "
            "(registers, spills, shared memory, instructions per weight) with a roofline estimate", MEASURE),
    Command("kernels-bench", "kernels.bench", "time the Triton kernels against bf16 and 2:4 references (GPU)",
            MEASURE),
    Command("report", "eval.report", "a run's degradation report: every stage's evaluation as a table and "
            "plots", ANALYSE),
    Command("compare", "eval.compare", "two or more runs' stage evaluations side by side, with each one's "
            "difference", ANALYSE),
    Command("kl-tail", "eval.kl_tail", "which tokens make a model's KL P99, and whether they stay the same "
            "across models", ANALYSE),
    Command("needle-paired", "eval.needle_paired", "needle grids on the same prompts compared prompt by prompt "
            "(McNemar)", ANALYSE),
    Command("alpha-paired", "eval.alpha_paired", "two MTP modules' acceptance compared prompt by prompt",
            ANALYSE),
    Command("seed-spread", "eval.seed_spread", "a stage's quality across calibration seeds: the noise a change "
            "is judged against", ANALYSE),
    Command("chain-seeds", "eval.chain_seeds", "whole chains grouped by setting: each setting's scatter over "
            "seeds", ANALYSE),
    Command("mask-agreement", "eval.mask_agreement", "how far apart two pruned artifacts' 2:4 masks are, per "
            "block", ANALYSE),
    Command("compare-weights", "eval.compare_weights", "are two artifacts' tensors equal (file sha256 and "
            "tensor by tensor)", ANALYSE),
    Command("timeline", "eval.timeline", "minutes per recipe stage from a time-stamped recipe log", ANALYSE),
    Command("tables", "eval.tables", "regenerate the docs' result tables from committed JSON (--check: "
            "stale is an error)", PROJECT),
    Command("results-index", "eval.results_index", "regenerate results/INDEX.md (--check: a folder no page cites, "
            "or a cited one missing, is an error)", PROJECT),
    Command("defaults-history", "eval.defaults_history", "regenerate docs/defaults-history.md's table from "
            "committed JSON (--check: stale is an error)", PROJECT),
    Command("cli-doc", "smelt.cli_doc", "regenerate docs/cli.md from these parsers (--check: stale is an "
            "error)", PROJECT),
]}


def overview() -> str:
    width = max(map(len, COMMANDS)) + 2
    lines = ["usage: smelt COMMAND [ARGS ...]        smelt COMMAND --help: the command's options", "",
             "smelt: a teacher LLM -> pruned, distilled, W4 release, every stage measured by its KL to the teacher.",
             ""]
    for section in dict.fromkeys(c.section for c in COMMANDS.values()):
        lines.append(f"{section}:")
        lines += [f"  {c.name:<{width}}{c.summary}" for c in COMMANDS.values() if c.section == section]
        lines.append("")
    lines.append("Every command is also `python -m MODULE` (docs/cli.md lists them).")
    return "\n".join(lines)


# ---- running a module's main() as `smelt SUB` ---------------------------------------------------------
@contextmanager
def named(module: str, prog: str) -> Iterator[None]:
    """Parsers the module builds with prog `python -m MODULE` are named `prog` (help, usage and errors)."""
    old, init = f"python -m {module}", argparse.ArgumentParser.__init__

    def renamed(self, *args, **kwargs):
        if kwargs.get("prog") == old:
            kwargs["prog"] = prog
        if isinstance(kwargs.get("usage"), str):
            kwargs["usage"] = kwargs["usage"].replace(old, prog)
        init(self, *args, **kwargs)

    argparse.ArgumentParser.__init__ = renamed
    try:
        yield
    finally:
        argparse.ArgumentParser.__init__ = init


def call_main(module: str, prog: str, argv: list[str]):
    """Run `module`.main with argv (through sys.argv too, for a main() that reads it) under the name `prog`."""
    main: Callable = importlib.import_module(module).main
    saved = sys.argv
    sys.argv = [prog, *argv]
    try:
        with named(module, prog):
            return main(argv) if inspect.signature(main).parameters else main()
    finally:
        sys.argv = saved


class _Parser(Exception):  # carries the parser out of main(); not an error
    def __init__(self, parser: argparse.ArgumentParser):
        super().__init__(parser.prog)
        self.parser = parser


def parser_of(command: Command) -> argparse.ArgumentParser:
    """The parser `smelt COMMAND` parses its arguments with, taken when main() asks it to parse (nothing runs)."""
    prog, parse = f"smelt {command.name}", argparse.ArgumentParser.parse_known_args

    def caught(self, args=None, namespace=None):
        if self.prog == prog:
            raise _Parser(self)
        return parse(self, args, namespace)

    argparse.ArgumentParser.parse_known_args = caught
    try:
        call_main(command.module, prog, [])
    except _Parser as p:
        return p.parser
    finally:
        argparse.ArgumentParser.parse_known_args = parse
    raise SmeltError(f"smelt {command.name}: {command.module}.main() returned without parsing its arguments")


def recipe_path(arg: str) -> str:
    """A recipe argument: an existing path as given, else the shipped recipe of that name."""
    if Path(arg).exists():
        return arg
    # here, not at the top: configs loads the recipe types, which `smelt --help` does not need
    from configs.recipe_spec import RECIPES
    from smelt.recipes import shown

    for candidate in (RECIPES / arg, RECIPES / f"{arg}.toml"):
        if candidate.is_file():
            return shown(candidate)
    names = sorted(p.stem for p in RECIPES.glob("*.toml"))
    raise SmeltError(f"recipe {arg!r}: no such file and no recipe of that name in {RECIPES} "
                     f"({', '.join(names)}; `smelt recipes` describes them)")


def resolve_recipe(command: Command, argv: list[str]) -> list[str]:
    """argv with its recipe positional (the first argument that is no option nor an option's value) resolved."""
    options = parser_of(command)._option_string_actions
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            return argv
        if arg == "--":
            i += 1
            break
        if not arg.startswith("-") or arg == "-":
            break
        action = options.get(arg.split("=", 1)[0])
        i += 2 if action is not None and action.nargs != 0 and "=" not in arg else 1
    if i < len(argv):
        return [*argv[:i], recipe_path(argv[i]), *argv[i + 1:]]
    return argv


def run(argv: list[str]) -> int | None:
    if not argv or argv[0] in ("-h", "--help"):
        print(overview())
        return None
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f"did you mean `smelt {close[0]}`? " if close else ""
        raise SmeltError(f"smelt: unknown command {name!r}; {hint}`smelt --help` lists them")
    command = COMMANDS[name]
    if command.recipe:
        rest = resolve_recipe(command, rest)
    return call_main(command.module, f"smelt {name}", [*rest, *command.prefix])


def main(argv: list[str] | None = None) -> None:
    """The console entry point ([project.scripts] smelt): errors are one line, exit status 2."""
    run_cli(lambda: run(sys.argv[1:] if argv is None else list(argv)))


if __name__ == "__main__":
    main()
