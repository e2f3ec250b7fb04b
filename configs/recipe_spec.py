"""The recipe file format: loaded from TOML with --set values into its types (configs.recipe_stages), checked once.

A recipe file may build on another (`extends = "FILE"`, relative to its own folder): it takes the base's values,
sets its own name, run_dir and catalogue keys, inserts its [[stages]] tables into the base's chain (each after the
stage its `after` names, else after the table before it in the file; the first without one at the end) and changes
the base's values with a [set] table of KEY = VALUE, the keys of --set. `catalog` lists configs/recipes/ for
`smelt recipes`. `configs.recipe` plans and runs what this describes; configs/recipes/smollm2-cpu.toml is the
commented example of the format.
"""
from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import NamedTuple

import torch

from configs.memory import read_registry
from configs.recipe_stages import (
    FLOAT_MODELS,
    KINDS,
    MODELS,
    NAME,
    QUANTIZED,
    TYPES,
    HeadsStage,
    InputStage,
    PruneStage,
    PtqStage,
    QuantReconstructStage,
    Recipe,
    ReconstructStage,
    ReleaseStage,
    SelfTextStage,
    Stage,
    TeacherCacheStage,
    TrainStage,
)
from configs.schema import build, read_toml
from core.calibrate import (
    FORWARD_DTYPES,
    HESSIAN_DTYPES,
    RECONSTRUCT_FITS,
    RECONSTRUCT_INPUTS,
    REFIT_TARGETS,
    CalibConfig,
    check_reconstruct,
)
from core.data import WINDOW_SAMPLING, EvalConfig, SelfTextConfig, split_corpora
from core.device import bf16_is_fast
from core.errors import SmeltError
from core.patterns import NMPattern
from core.text_source import SELF_TEXT_FILE, TextSourceConfig

# ---- loading: TOML, extends, environment, --set; typed; checked -------------------------------------------
RECIPES = Path(__file__).parent / "recipes"  # the catalogue: the recipes this repository ships
META = ("description", "hardware", "measured")  # the catalogue's keys: what it is, sized for, measured wall time
EXTENDING = ("extends", "name", "run_dir", *META, "set", "stages")  # the keys of a file that extends another


def _assign(values: dict, key: str, value, label: str) -> None:
    """Set the dotted `key` of the raw TOML values (`stages.NAME.key` finds the stage by name); errors start with
    `label`."""
    node, parts = values, key.split(".")
    if parts[0] == "stages" and len(parts) > 2:
        chain = values["stages"] if isinstance(values.get("stages"), list) else []
        names = [_stage_name(s) for s in chain]
        if parts[1] not in names:
            raise SmeltError(f"{label}: no stage named {parts[1]!r} (stages: {', '.join(map(str, names))})")
        node, parts = chain[names.index(parts[1])], parts[2:]
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise SmeltError(f"{label}: {part!r} is not a table")
    node[parts[-1]] = value


def set_value(values: dict, assignment: str) -> None:
    """Apply one `--set a.b.c=VALUE` to the raw TOML values; VALUE is read as TOML, else kept as a string."""
    key, sep, raw = assignment.partition("=")
    if not sep or not key:
        raise SmeltError(f"--set {assignment!r}: expected KEY=VALUE, e.g. stages.recover.steps=2")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare word or a path
    _assign(values, key, value, f"--set {key}")


def _stage_name(raw) -> str | None:
    return raw.get("name", raw.get("kind")) if isinstance(raw, dict) else None


def _leaves(table: dict, prefix: str = ""):
    """(dotted key, value) of a [set] table: a table value is set key by key, so it merges into the base's."""
    for key, value in table.items():
        if isinstance(value, dict) and value:
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def read_values(path: str | Path, _within: tuple = ()) -> dict:
    """A recipe file's raw values, `extends` resolved (this module's docstring): what --set then changes."""
    path = Path(path)
    values = read_toml(path, "recipe")
    if "extends" not in values:
        if "set" in values:
            raise SmeltError(f"recipe {path}: [set] changes a base recipe's values (with extends = FILE); "
                             f"this file has no base: set the values directly")
        return values
    ref = values["extends"]
    if not isinstance(ref, str) or not ref:
        raise SmeltError(f"recipe {path}: extends = {ref!r} must be a recipe file (relative to {path.parent})")
    base_path = path.parent / ref
    if base_path.resolve() in (*_within, path.resolve()):
        raise SmeltError(f"recipe {path}: extends {ref!r} is a cycle (a recipe extends itself)")
    base = read_values(base_path, (*_within, path.resolve()))
    for key in values:
        if key not in EXTENDING:
            raise SmeltError(f"recipe {path}: {key!r} is not a key of a recipe that extends another (valid: "
                             f"{', '.join(EXTENDING)}); change the base's values in [set], e.g. {key}.KEY = VALUE")
    for key in ("name", "run_dir"):  # a shared run_dir would skip the base's finished stages into this chain
        if key not in values:
            raise SmeltError(f"recipe {path}: a recipe that extends another sets its own {key}")
    for key in ("name", *META):  # they describe the base, not this file
        base.pop(key, None)
    base.update({k: values[k] for k in ("name", "run_dir", *META) if k in values})
    for where, table in ((base_path, base), (path, values)):
        if not isinstance(table.get("stages", []), list):
            raise SmeltError(f"recipe {where}: stages must be [[stages]] tables")
    chain, after = list(base.get("stages", [])), None
    for i, raw in enumerate(values.get("stages", [])):
        if not isinstance(raw, dict):
            raise SmeltError(f"recipe {path}: stages[{i}] must be a [[stages]] table")
        raw = dict(raw)
        if "after" in raw:
            names = [_stage_name(s) for s in chain]
            if raw["after"] not in names:
                raise SmeltError(f"recipe {path}: stages[{i}].after {raw['after']!r} is not a stage of the chain "
                                 f"({', '.join(map(str, names))})")
            after = names.index(raw.pop("after")) + 1
        at = len(chain) if after is None else after
        chain.insert(at, raw)
        after = at + 1
    base["stages"] = chain
    if not isinstance(values.get("set", {}), dict):
        raise SmeltError(f"recipe {path}: set must be a table of KEY = VALUE ([set])")
    for key, value in _leaves(values.get("set", {})):
        _assign(base, key, value, f"recipe {path}: set.{key}")
    return base


class RecipeInfo(NamedTuple):
    name: str
    path: Path
    description: str
    hardware: str
    measured: str


def catalog(directory: str | Path = RECIPES) -> list[RecipeInfo]:
    """Every recipe in `directory` (*.toml, by file name) with what it is, what hardware it is sized for and its
    measured wall time; a file without one of those three keys is one SmeltError naming it."""
    out = []
    for path in sorted(Path(directory).glob("*.toml")):
        values = read_values(path)
        for key in ("name", *META):
            _check_line(values.get(key), f"recipe {path}: {key}", required=True)
        out.append(RecipeInfo(values["name"], path, *(values[k] for k in META)))
    return out


def _check_line(value, where: str, required: bool = False) -> None:
    if value is None and not required:
        return
    if not isinstance(value, str) or not value.strip() or "\n" in value:
        raise SmeltError(f"{where} = {value!r}: one line of text is required" if value is not None else
                         f"{where} is missing (a catalogued recipe says what it is, the hardware it is sized for "
                         f"and its measured wall time)")


def load(path: str | Path, sets: list[str] = (), env: dict | None = None) -> Recipe:
    """Read, override and check a recipe: every problem is one SmeltError naming the key."""
    path, env = Path(path), os.environ if env is None else env
    values = read_values(path)
    for var, key in (("SMELT_NNODES", "nodes"), ("SMELT_NPROC", "nproc")):
        if env.get(var):
            set_value(values, f"parallelism.{key}={env[var]}")
    for s in sets:
        set_value(values, s)
    recipe = build(Recipe, values)
    for key in META:
        _check_line(getattr(recipe, key), key)
    stages = []
    for i, raw in enumerate(recipe.stages):
        if not isinstance(raw, dict) or raw.get("kind") not in TYPES:
            kind = raw.get("kind") if isinstance(raw, dict) else None
            raise SmeltError(f"stages[{i}].kind {kind!r} is not one of {', '.join(KINDS)}")
        stages.append(build(TYPES[raw["kind"]], raw, f"stages[{i}]"))
    recipe.stages = stages
    check(recipe, read_registry())
    return recipe


def _input(st: Stage, where: str, outputs: dict, default: str | None, want: tuple, field: str = "input") -> str:
    """What a stage reads (its `field`): an earlier stage's output (by name), an existing directory, or `default`."""
    ref = getattr(st, field) or default
    if ref is None:
        raise SmeltError(f"{where} ({st.kind}) has no input: no earlier stage writes a {' or '.join(want)} "
                         f"artifact; set {where}.{field} to a stage name or an artifact directory")
    if ref in outputs:
        kind, path = outputs[ref]
        if kind not in want:
            raise SmeltError(f"{where}.{field} {ref!r} is a {kind} stage; a {st.kind} stage's {field} is "
                             f"{' or '.join(want)} output")
        return path
    if Path(ref).is_dir():
        return ref
    raise SmeltError(f"{where}.{field} {ref!r} is neither an earlier stage nor an existing artifact directory")


def _budget(recipe: Recipe, st: TrainStage, where: str, registry: dict) -> dict:
    if st.config not in registry:
        raise SmeltError(f"{where}.config {st.config!r} is not a config of train/config_registry.py "
                         f"({', '.join(registry)})")
    if st.steps <= 0:
        raise SmeltError(f"{where}.steps={st.steps} must be > 0")
    reg = registry.get(st.config, {})
    b = {k: reg.get(k) if getattr(st, k) is None else getattr(st, k)
         for k in ("local_batch", "global_batch", "seq_len", "dtype")}
    b.update(steps=st.steps, config=st.config, source=st.source or recipe.data.train or reg.get("source"),
             activation_checkpoint=reg.get("activation_checkpoint", False),
             fake_quant=reg.get("fake_quant", False))
    for key in ("local_batch", "seq_len"):
        if b[key] is None:
            raise SmeltError(f"{where}.{key} is required (config {st.config or '-'} does not set it)")
    b["dtype"] = b["dtype"] or "float32"
    if b["dtype"] == "auto":  # bf16 compute only where it runs fast: emulated bf16 is many times slower than fp32
        b["dtype"] = "bfloat16" if recipe.parallelism.device == "gpu" or bf16_is_fast(torch.device("cpu")) \
            else "float32"
    if b["dtype"] not in ("float32", "bfloat16"):
        raise SmeltError(f"{where}.dtype {b['dtype']!r} is not float32, bfloat16 or auto")
    if b["local_batch"] < 1 or b["seq_len"] < 2:
        raise SmeltError(f"{where}: local_batch >= 1 and seq_len >= 2 are required")
    per_step = b["local_batch"] * recipe.dp
    b["global_batch"] = b["global_batch"] or per_step
    if b["global_batch"] % per_step:
        raise SmeltError(f"{where}.global_batch={b['global_batch']} is not divisible by local_batch "
                         f"{b['local_batch']} x data-parallel degree {recipe.dp} "
                         f"({recipe.parallelism.nodes} node(s) x {recipe.parallelism.nproc} ranks)")
    flags = {"local_batch": "--training.local_batch_size", "global_batch": "--training.global_batch_size",
             "seq_len": "--training.seq_len", "dtype": "--training.mixed_precision_param",
             "source": "--dataloader.source"}
    # Only what differs from the config is passed: a recipe restating it runs scripts/recipe.sh's command.
    b["overrides"] = [x for k, flag in flags.items() if b[k] is not None and b[k] != reg.get(k)
                      for x in (flag, str(b[k]))]
    if st.lr is not None:  # passed whenever set: the registry does not read a config's lr
        if not st.lr > 0:
            raise SmeltError(f"{where}.lr={st.lr!r} must be > 0")
        b["overrides"] += ["--optimizer.param-groups.0.optimizer-kwargs.lr", repr(float(st.lr))]
    return b


def _check_cache_reader(recipe: Recipe, st: TrainStage, where: str, outputs: dict) -> None:
    """A training stage's teacher_cache: an earlier teacher_cache stage whose windows are this stage's."""
    if outputs.get(st.teacher_cache, ("",))[0] != "teacher_cache":
        raise SmeltError(f"{where}.teacher_cache {st.teacher_cache!r} is not an earlier teacher_cache stage")
    cache = next(s for s in recipe.stages if s.name == st.teacher_cache)
    b = st.budget
    for key, mine in (("seq_len", b["seq_len"]), ("local_batch", b["local_batch"])):
        if getattr(cache, key) != mine:
            raise SmeltError(f"{where}.teacher_cache {cache.name!r} holds {key} {getattr(cache, key)}; this "
                             f"stage trains with {mine}")
    b["overrides"] += ["--dataloader.teacher_cache", cache.dst]


def _self_text_settings(st: SelfTextStage, where: str) -> SelfTextConfig:
    keys = ("corpus", "prompts", "prompt_len", "new_tokens", "batch_size", "temperature", "seed")
    return SelfTextConfig(**{k: getattr(st, k) for k in keys if getattr(st, k) is not None}, flag=f"{where}.")


def _train_source(st: TrainStage, where: str, outputs: dict, stages: dict) -> str:
    """A training stage's own text: an earlier self_text stage's file, or a text source checked now."""
    if st.teacher_cache is not None:
        raise SmeltError(f"{where}: source and teacher_cache together (a teacher_cache holds data.train's "
                         f"windows); set one")
    if outputs.get(st.source, ("",))[0] == "self_text":
        st.reads = str(Path(outputs[st.source][1]) / SELF_TEXT_FILE)
        return st.reads
    if st.source in stages:
        index, kind = stages[st.source]
        what = "this" if st.source == st.name else "a later" if index > stages[st.name][0] else f"a {kind}"
        raise SmeltError(f"{where}.source {st.source!r} is {what} stage; a training stage reads an earlier "
                         f"self_text stage's text or a text source")
    try:
        TextSourceConfig(source=st.source)
    except SmeltError as e:
        raise SmeltError(f"{where}.source: {e}") from None
    return st.source


def metrics_source(recipe: Recipe, st: ReleaseStage, index: int | None = None) -> str:
    """The artifact whose evaluation a release keeps: its input, or, when that is an unevaluated mtp stage
    (modules trained on a frozen main model), that stage's input, whose main model it is (qat.release checks
    the main model's fingerprint, so a jointly trained one is refused there)."""
    stages = recipe.stages[:index] if index is not None else recipe.stages
    src = st.src
    while True:
        parent = next((s for s in stages if s.dst == src), None)
        if parent is None or parent.kind != "mtp" or parent.evaluate:
            return src
        src = parent.src


def _carry_mtp(st: Stage, where: str, registry: dict, modules: dict) -> None:
    """Training, PTQ and reconstruct stages carry their input's MTP module; an mtp stage continues it, and loading it into
    modules built for other fused blocks fails: refuse that now, not an hour into the chain."""
    carried = modules.get(st.src)
    if st.kind != "mtp":
        if carried is not None:
            modules[st.dst] = carried
        return
    fused = tuple(registry[st.config].get("fuse_layers", ()))
    if carried is not None and carried[1] != fused:
        raise SmeltError(f"{where}.config {st.config!r} builds modules reading main-model blocks {list(fused)} "
                         f"(mtp.fuse_layers); the module it continues, stage {carried[0]!r}'s, reads {list(carried[1])}")
    modules[st.dst] = (st.name, fused)


def check(recipe: Recipe, registry: dict) -> None:
    """Everything that can be checked before running: values, names, the chain of inputs and outputs."""
    par = recipe.parallelism
    if par.nodes < 1 or par.nproc < 1 or par.device not in ("cpu", "gpu"):
        raise SmeltError(f"parallelism: nodes >= 1, nproc >= 1 and device 'cpu' or 'gpu' are required "
                         f"(got {par.nodes}, {par.nproc}, {par.device!r})")
    # The same checks train.launch, prune.run and qat.ptq make: a missing file fails now, not in a job hours
    # into the chain.
    for key, check_source in (("train", lambda v: TextSourceConfig(source=v)),
                              ("calibration", lambda v: CalibConfig(corpus=v))):
        value = getattr(recipe.data, key)
        if value:
            try:
                check_source(value)
            except SmeltError as e:
                raise SmeltError(f"data.{key}: {e}") from None
    if recipe.data.calibration_sampling not in WINDOW_SAMPLING:
        raise SmeltError(f"data.calibration_sampling {recipe.data.calibration_sampling!r} is not one of "
                         f"{', '.join(WINDOW_SAMPLING)}")
    if recipe.eval is not None:
        build(EvalConfig, recipe.eval, "eval")
    if not recipe.stages:
        raise SmeltError("a recipe needs at least one [[stages]] table")
    run, names = Path(recipe.run_dir), set()
    outputs = {"teacher": ("teacher", recipe.teacher)}  # name -> (kind, path) of what later stages read
    last = {"model": None, "release": None}
    written = {}  # output path -> the stage that writes it
    modules = {}  # artifact path -> (the mtp stage that trained its MTP module, the blocks that module reads)
    positions = {s.name or s.kind: (j, s.kind) for j, s in enumerate(recipe.stages)}  # what a `source` may name
    for i, st in enumerate(recipe.stages):
        where = f"stages[{i}]"
        st.name = st.name or st.kind
        teacher_name = (st.name == "teacher") != (st.kind == "teacher")
        if st.name in names or not NAME.fullmatch(st.name) or teacher_name:
            raise SmeltError(f"{where}.name {st.name!r}: names are unique, made of letters, digits, '_', "
                             f"'.' and '-', and 'teacher' is the teacher stage's")
        names.add(st.name)
        if st.kind == "teacher":
            st.dst = recipe.teacher
        elif st.kind in MODELS or st.kind == "release":
            st.dst = str(run / (st.out or st.name))
        if st.needle and not getattr(st, "evaluate", st.kind == "evaluate"):
            raise SmeltError(f"{where}.needle: a {st.kind} stage{' with evaluate = false' * hasattr(st, 'evaluate')} "
                             f"is not evaluated")
        if isinstance(st, HeadsStage):
            st.dst = str(run / f"{st.out or st.name}.json")
            if st.top_k is not None and st.top_k < 1:
                raise SmeltError(f"{where}.top_k={st.top_k} must be >= 1")
            outputs[st.name] = ("heads", st.dst)
        if isinstance(st, PruneStage) and st.protect is not None:
            if outputs.get(st.protect, ("",))[0] == "heads":
                st.protect = outputs[st.protect][1]
            elif not Path(st.protect).is_file():
                raise SmeltError(f"{where}.protect {st.protect!r} is neither an earlier heads stage nor a "
                                 f"prune.heads JSON file")
        if isinstance(st, PruneStage) and st.skip is not None and not all(e.strip() and "," not in e
                                                                           for e in st.skip):
            raise SmeltError(f"{where}.skip {st.skip!r}: each entry is one module name, prefix or suffix "
                             f"(e.g. \"attention.wq\")")
        if isinstance(st, PruneStage) and (st.pattern is None) == (st.sparsity is None):
            raise SmeltError(f"{where}: set exactly one of pattern (N:M) and sparsity")
        if isinstance(st, PruneStage) and st.pattern is not None:
            NMPattern.parse(st.pattern, f"{where}.pattern")
        if isinstance(st, HeadsStage) and st.needle_samples is not None and st.needle_samples < 1:
            raise SmeltError(f"{where}.needle_samples={st.needle_samples} must be >= 1")
        if isinstance(st, (PruneStage, PtqStage, ReconstructStage)) and st.calib_windows is not None:
            corpora = len(split_corpora(recipe.data.calibration)) if recipe.data.calibration else 1
            if st.calib_windows < corpora:  # each corpus of the mix gets at least one window
                raise SmeltError(f"{where}.calib_windows={st.calib_windows} is fewer than the {corpora} corpora "
                                 f"of data.calibration {recipe.data.calibration!r}: each needs a window")
        if isinstance(st, ReconstructStage) and ((st.lr is not None and not st.lr > 0)
                                                 or (st.epochs is not None and st.epochs < 1)):
            raise SmeltError(f"{where}: lr > 0 and epochs >= 1 are required (got {st.lr}, {st.epochs})")
        if isinstance(st, QuantReconstructStage) and st.scale_lr is not None and not st.scale_lr > 0:
            raise SmeltError(f"{where}.scale_lr={st.scale_lr} must be > 0")
        if isinstance(st, ReconstructStage):  # qat.reconstruct fits on the quantized model's own stream by default
            default = "block" if isinstance(st, QuantReconstructStage) else RECONSTRUCT_INPUTS[0]
            check_reconstruct(st.inputs or default, st.fit or RECONSTRUCT_FITS[0], f"{where}.")
        if isinstance(st, PruneStage) and st.refit == "none":  # TOML has no null: how --set turns a file's refit off
            st.refit = None
        if isinstance(st, PruneStage) and st.refit not in (None, *REFIT_TARGETS):
            raise SmeltError(f"{where}.refit {st.refit!r} is not one of {', '.join((*REFIT_TARGETS, 'none'))}")
        if isinstance(st, PruneStage) and st.refit == "teacher" and st.calib_true_sequential:
            raise SmeltError(f"{where}: refit = \"teacher\" needs calib_true_sequential = false (the teacher's "
                             "stream runs each block unchanged)")
        if isinstance(st, (PruneStage, PtqStage)) and st.calib_forward not in (None, *FORWARD_DTYPES):
            raise SmeltError(f"{where}.calib_forward {st.calib_forward!r} is not one of {', '.join(FORWARD_DTYPES)}")
        if isinstance(st, (PruneStage, PtqStage)) and st.calib_hessian not in (None, *HESSIAN_DTYPES):
            raise SmeltError(f"{where}.calib_hessian {st.calib_hessian!r} is not one of {', '.join(HESSIAN_DTYPES)}")
        if isinstance(st, ReleaseStage) and st.dtype not in ("bfloat16", "float16", "float32"):
            raise SmeltError(f"{where}.dtype {st.dtype!r} is not one of bfloat16, float16, float32")
        if isinstance(st, ReleaseStage) and st.sparse_storage not in ("mask", "compressed"):
            raise SmeltError(f"{where}.sparse_storage {st.sparse_storage!r} is not one of mask, compressed")
        if isinstance(st, InputStage) and (st.kernel_layers < 0 or (st.kernel_layers and st.kind != "verify")):
            raise SmeltError(f"{where}.kernel_layers={st.kernel_layers}: a verify stage's block count (>= 0)")
        if st.kind == "verify":
            st.src = _input(st, where, outputs, last["release"], ("release",))
        elif st.kind == "evaluate":
            st.src = _input(st, where, outputs, last["model"] or "teacher", (*MODELS, "teacher"))
            st.dst = recipe.evals(st.name)
        elif st.kind == "ptq":  # quantizes the teacher itself when nothing came before
            st.src = _input(st, where, outputs, last["model"] or "teacher", (*MODELS, "teacher"))
        elif st.kind == "qreconstruct":
            st.src = _input(st, where, outputs, last["model"], QUANTIZED)
            if st.target == "":
                raise SmeltError(f"{where}.target is empty: name an earlier float model stage or a directory "
                                 "(unset: the teacher)")
            if st.target is not None:  # a float model of the same shapes; quantized ones would aim at their own grid
                st.target = _input(st, where, outputs, None, FLOAT_MODELS, field="target")
        elif hasattr(st, "input"):
            st.src = _input(st, where, outputs, last["model"], MODELS)
        if isinstance(st, TeacherCacheStage):
            st.dst = str(run / (st.out or st.name))
            for key in ("top_k", "windows", "seq_len", "local_batch"):
                if getattr(st, key) < 1:
                    raise SmeltError(f"{where}.{key}={getattr(st, key)} must be >= 1")
            if st.dtype not in ("float32", "bfloat16"):
                raise SmeltError(f"{where}.dtype {st.dtype!r} is not float32 or bfloat16")
            if recipe.data.train is None:
                raise SmeltError(f"{where} needs data.train (the training text it caches the teacher on)")
            outputs[st.name] = ("teacher_cache", st.dst)
        if isinstance(st, SelfTextStage):
            st.dst = str(run / (st.out or st.name))
            st.settings = _self_text_settings(st, where)
            outputs[st.name] = ("self_text", st.dst)
        if isinstance(st, TrainStage):
            if st.source is not None:
                st.source = _train_source(st, where, outputs, positions)
            st.budget = _budget(recipe, st, where, registry)
            if st.teacher_cache is not None:
                _check_cache_reader(recipe, st, where, outputs)
        if st.kind in ("reconstruct", "recover", "mtp", "ptq", "qreconstruct", "qat"):
            _carry_mtp(st, where, registry, modules)
        if isinstance(st, ReleaseStage) and st.metrics:
            parent = next((s for s in recipe.stages[:i] if s.dst == metrics_source(recipe, st, i)), None)
            if parent is not None and not parent.evaluate:
                raise SmeltError(f"{where}.metrics needs stage {parent.name!r} evaluated (evaluate = true), "
                                 f"or set metrics = false")
        if st.kind in MODELS or st.kind == "release":
            outputs[st.name] = (st.kind, st.dst)
            last["model" if st.kind in MODELS else "release"] = st.name
        if st.dst and st.kind != "teacher":  # else the later stage is skipped as if done, over another's output
            if st.dst in written:
                raise SmeltError(f"{where}.out: {st.dst} is stage {written[st.dst]!r}'s output too")
            written[st.dst] = st.name


