"""A recipe: one TOML file for the whole chain (teacher -> prune -> recover -> ptq -> qat -> release ...),
checked once, then planned (`--dry-run`) or run stage by stage, each stage as child processes.

    python -m configs.recipe configs/recipes/smollm2-cpu.toml --dry-run [--json plan.json]
    python -m configs.recipe RECIPE.toml --list-stages          # one stage name a line (one Slurm job each)
    python -m configs.recipe RECIPE.toml --training-stages      # those that train: the others need one node
    python -m configs.recipe RECIPE.toml [--stage NAME] [--set KEY=VALUE ...]   # run every stage, or one

configs/recipes/smollm2-cpu.toml is the commented example of the format. Relative paths are relative to the
working directory: the repository root, as in scripts/recipe.sh. A stage whose output exists is skipped,
and so is an evaluation whose JSON exists; verify and report always run.

--set KEY=VALUE changes a value of the file before anything is checked. KEY is a dotted path; a stage is
addressed by its name: `stages.recover.steps=2`, `parallelism.nproc=1`, `run_dir=/tmp/run`,
`eval.windows={en=2}`. VALUE is read as a TOML value, else taken as a string. SMELT_NNODES / SMELT_NPROC
(set by slurm/stage.sbatch) apply as parallelism.nodes / .nproc before the --set values; training commands
get --nnodes/--rdzv-endpoint/--rdzv-id from SMELT_NNODES, SMELT_RDZV_ENDPOINT and SMELT_RDZV_ID, and are
prefixed with the words of SMELT_LAUNCH_PREFIX (an srun step).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

from configs.memory import FORMULAS, GIB, Budget, estimate, find_shape, format_plan, teacher_dir
from configs.recipe_spec import load, metrics_source
from configs.recipe_stages import (
    PY,
    TRAINING,
    Recipe,
    ReleaseStage,
    SelfTextStage,
    Stage,
    TrainStage,
)
from configs.schema import build
from core.block_fit import CALIB
from core.calibrate import HEADS_CALIB, CalibConfig
from core.data import (
    EvalConfig,
    corpus_token_counts,
    distinct_tokens,
    is_corpus_mix,
    split_corpora,
    window_starts,
)
from core.errors import ArgumentParser, SmeltError, run_cli
from core.files import atomic_write_text


# ---- commands ------------------------------------------------------------------------------------------
def eval_command(recipe: Recipe, model: str | None, out: str, needle: bool = False) -> list[str]:
    # --wandb: the evaluation's metrics and table go into its stage's wandb run (core.tracking).
    cmd = [PY, "-m", "eval.evaluate", "--teacher", recipe.teacher, *(["--model", model] if model else []),
           "--out", out, "--wandb", *(["--needle"] if needle else [])]
    return cmd + (build(EvalConfig, recipe.eval, "eval").cli_args() if recipe.eval is not None else [])


def _opt(flag: str, value) -> list[str]:
    return [] if value is None or value is False else [flag] if value is True else [flag, str(value)]


def _sampling(recipe: Recipe) -> list[str]:
    """--calib-sampling where the recipe's differs from the CLIs' default (a recipe restating it runs recipe.sh's
    commands)."""
    sampling = recipe.data.calibration_sampling
    return [] if sampling == CalibConfig.sampling else ["--calib-sampling", sampling]


def commands(recipe: Recipe, st: Stage, env: dict) -> list[list[str]]:
    """The stage's own commands, in order (the evaluation after it: `evaluation`)."""
    t, par, calib = recipe.teacher, recipe.parallelism, recipe.data.calibration
    if st.kind == "teacher":
        sources = [calib or ""] + [s.budget["source"] or "" for s in recipe.stages if isinstance(s, TrainStage)]
        sources += [s.settings.corpus for s in recipe.stages if isinstance(s, SelfTextStage)]
        fetch = ["zh-train"] if any("zh-train" in s.split("+") for s in sources) else []
        fetch += ["en-news"] if "news" in (recipe.eval or {}).get("windows", {}) else []
        # fetched once, before any rank (or evaluation) reads them
        return [[PY, "-m", "models.teacher", "--teacher", t]] + ([[PY, "-m", "core.fetched_corpora", *fetch]]
                                                                 if fetch else [])
    if st.kind == "heads":
        return [[PY, "-m", "prune.heads", "--teacher", t, *_opt("--top-k", st.top_k),
                 *_opt("--calib-windows", st.calib_windows), *_sampling(recipe),
                 *_opt("--needle-lengths", st.needle_lengths),
                 *_opt("--needle-samples", st.needle_samples), "--out", st.dst,
                 "--png", st.dst.removesuffix(".json") + ".png"]]
    if st.kind == "prune":
        return [[PY, "-m", "prune.run", "--teacher", t, "--method", st.method, *_opt("--pattern", st.pattern),
                 *_opt("--protect", st.protect), *_opt("--skip", ",".join(st.skip) if st.skip else None),
                 *_opt("--sparsity", st.sparsity), *_opt("--calib-windows", st.calib_windows),
                 *_opt("--calib-seq-len", st.calib_seq_len), *_opt("--calib-forward", st.calib_forward),
                 *_opt("--calib-hessian", st.calib_hessian), *_opt("--calib-true-sequential", st.calib_true_sequential),
                 *_opt("--calib-corpus", calib), *_sampling(recipe), *_opt("--refit", st.refit), "--out", st.dst]]
    if st.kind in ("reconstruct", "qreconstruct"):
        module = "prune.reconstruct" if st.kind == "reconstruct" else "qat.reconstruct"
        # a qreconstruct stage's target, where set, stands in for the teacher: its block outputs are what is fitted
        target = getattr(st, "target", None) or t
        return [[PY, "-m", module, "--artifact", st.src, "--teacher", target, *_opt("--lr", st.lr),
                 *_opt("--scale-lr", getattr(st, "scale_lr", None)),
                 *_opt("--epochs", st.epochs), *_opt("--inputs", st.inputs), *_opt("--fit", st.fit),
                 *_opt("--calib-windows", st.calib_windows), *_opt("--calib-seq-len", st.calib_seq_len),
                 *_opt("--calib-corpus", calib), *_sampling(recipe), "--out", st.dst]]
    if st.kind == "teacher_cache":
        return [[PY, "-m", "distill.teacher_cache", "--teacher", t, "--source", recipe.data.train,
                 "--seq-len", str(st.seq_len), "--windows", str(st.windows), "--top-k", str(st.top_k),
                 "--ranks", str(recipe.dp), "--local-batch", str(st.local_batch), "--dtype", st.dtype,
                 "--out", st.dst]]
    if st.kind == "self_text":
        return [[PY, "-m", "distill.self_text", "--model", st.src, "--teacher", t, *_opt("--corpus", st.corpus),
                 *_opt("--prompts", st.prompts), *_opt("--prompt-len", st.prompt_len),
                 *_opt("--new-tokens", st.new_tokens), *_opt("--batch-size", st.batch_size),
                 *_opt("--temperature", st.temperature), *_opt("--seed", st.seed), "--out", st.dst]]
    if st.kind in TRAINING:
        launch = [*shlex.split(env.get("SMELT_LAUNCH_PREFIX", "")), PY, "-m", "train.launch", "--nproc",
                  str(par.nproc)]
        if par.nodes > 1 or env.get("SMELT_RDZV_ENDPOINT"):
            launch += ["--nnodes", str(par.nodes), "--rdzv-endpoint",
                       env.get("SMELT_RDZV_ENDPOINT") or "$SMELT_RDZV_ENDPOINT",
                       "--rdzv-id", env.get("SMELT_RDZV_ID") or "smelt"]
        return [[*launch, "--", "--module", "train.config_registry", "--config", st.config,
                 "--student", st.src, "--teacher", t, "--dump_folder", f"{st.dst}-run",
                 "--export_dir", st.dst, "--training.steps", str(st.steps), *st.budget["overrides"]]]
    if st.kind == "ptq":
        return [[PY, "-m", "qat.ptq", "--teacher", t, *(["--artifact", st.src] if st.src != t else []),
                 "--method", st.method, *_opt("--bits", st.bits), *_opt("--act-order", st.act_order),
                 *_opt("--group-size", st.group_size), *_opt("--calib-windows", st.calib_windows),
                 *_opt("--calib-seq-len", st.calib_seq_len), *_opt("--calib-forward", st.calib_forward),
                 *_opt("--calib-hessian", st.calib_hessian), *_opt("--calib-true-sequential", st.calib_true_sequential),
                 *_opt("--calib-corpus", calib), *_sampling(recipe), "--out", st.dst]]
    if st.kind == "release":
        return [[PY, "-m", "qat.release", "--artifact", st.src, "--out", st.dst, "--dtype", st.dtype,
                 "--sparse-storage", st.sparse_storage,
                 *(["--metrics", recipe.evals(metrics_source(recipe, st))] if st.metrics else [])]]
    if st.kind == "verify":
        # Beside evals/, not in it: eval.report reads every evals/*.json as a model's evaluation.
        check = [[PY, "-m", "kernels.check", st.src, "--layers", str(st.kernel_layers), "--out",
                  str(Path(recipe.run_dir) / f"{st.name}-kernels.json")]] if st.kernel_layers else []
        return [[PY, "-m", "qat.verify", st.src], *check]
    if st.kind == "report":
        return [[PY, "-m", "eval.report", "--run", recipe.run_dir]]
    return [eval_command(recipe, None if st.src == t else st.src, st.dst, st.needle)]  # evaluate


def evaluation(recipe: Recipe, st: Stage, tdir: str | None) -> list[str] | None:
    """The evaluation after a stage into run_dir/evals/<output name>.json, as recipe.sh's `evaluate`."""
    if not getattr(st, "evaluate", False):
        return None
    if st.kind == "teacher":
        return eval_command(recipe, tdir or "<teacher dir>", recipe.evals("teacher"), st.needle)
    return eval_command(recipe, st.dst, recipe.evals(st.dst), st.needle)


# ---- the plan ------------------------------------------------------------------------------------------
CALIBRATING = {"heads": HEADS_CALIB, "prune": CalibConfig(), "ptq": CalibConfig(), "reconstruct": CALIB,
               "qreconstruct": CALIB}  # each stage CLI's calibration defaults (qat.ptq's are CalibConfig's)


def stage_calibration(recipe: Recipe, st: Stage, where: str) -> CalibConfig | None:
    """The calibration a stage's command runs (its CLI's defaults where the recipe says nothing); None: none."""
    base = CALIBRATING.get(st.kind)
    if base is None:
        return None
    n, seq_len = st.calib_windows, getattr(st, "calib_seq_len", None)
    try:  # a heads command is given no --calib-corpus: its CLI's own
        return CalibConfig(n_windows=base.n_windows if n is None else n,
                           seq_len=base.seq_len if seq_len is None else seq_len,
                           seed=base.seed, corpus=base.corpus if st.kind == "heads" else recipe.data.calibration
                           or base.corpus, sampling=recipe.data.calibration_sampling)
    except SmeltError as e:
        raise SmeltError(f"{where}: {e}") from None


def corpus_lengths(tdir: Path | None):
    """names -> [(corpus, token count)] by the teacher's tokenizer (loaded on first use), or None where the teacher
    or a fetched corpus is not on this machine: the plan never downloads."""
    tokenizer = None

    def lengths(names: list[str]) -> list[tuple[str, int]] | None:
        nonlocal tokenizer
        if tdir is None or not any((tdir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            return None
        if tokenizer is None:
            # transformers: seconds to import, only where it is used
            from core.tokenizer import load_tokenizer
            tokenizer = load_tokenizer(tdir)
            tokenizer.model_max_length = sys.maxsize  # counted, never fed to a model: no length warning
        return corpus_token_counts(tokenizer, names)
    return lengths


def calibration_plan(cfg: CalibConfig, where: str, has_seq_len: bool, lengths) -> dict:
    """A calibrating stage's windows, tokens and the distinct corpus tokens they cover (window_starts over the
    corpora's token counts; disjoint windows hold windows x (seq_len - 1) by construction). A disjoint draw that
    cannot fit is the one-line error the stage would give, naming the recipe's keys."""
    out = {"windows": cfg.n_windows, "seq_len": cfg.seq_len, "tokens": cfg.n_windows * cfg.seq_len,
           "corpus": cfg.corpus, "sampling": cfg.sampling, "distinct_tokens": None}
    counts = lengths(split_corpora(cfg.corpus, "calibration")) if is_corpus_mix(cfg.corpus) else None
    if counts is not None:
        fields = (f"{where}.calib_windows", f"{where}.calib_seq_len" if has_seq_len else "seq_len")
        starts = window_starts(counts, cfg.n_windows, cfg.seq_len, cfg.seed, cfg.sampling, fields)
        out.update(distinct_tokens=distinct_tokens(starts, cfg.seq_len), basis="counted on the teacher's tokenizer")
    elif not is_corpus_mix(cfg.corpus):
        out["basis"] = "a text source's consecutive chunks: not counted"
    elif cfg.sampling == "disjoint":
        out.update(distinct_tokens=cfg.n_windows * (cfg.seq_len - 1),
                   basis="disjoint by construction; their fit is checked where the teacher's tokenizer is")
    else:
        out["basis"] = "overlapping: counted where the teacher's tokenizer and corpora are"
    return out


def plan(recipe: Recipe, shape, env: dict, only: str | None = None) -> dict:
    par, tdir = recipe.parallelism, teacher_dir(recipe.teacher)
    out = {"recipe": recipe.name, "teacher": recipe.teacher, "teacher_dir": str(tdir) if tdir else None,
           "run_dir": recipe.run_dir, "parallelism": {**asdict(par), "dp": recipe.dp},
           "model": {**asdict(shape), "params": shape.params} if shape else None, "stages": [],
           "memory_formulas": FORMULAS, "notes": []}
    if shape is None:
        out["notes"].append(f"no config.json for teacher {recipe.teacher!r} here, so no shapes or memory: "
                            f"run `python -m models.teacher --teacher {recipe.teacher}` or pass "
                            f"--teacher-config")
    lengths = corpus_lengths(tdir)
    for i, st in enumerate(recipe.stages):
        if only and st.name != only:
            continue
        ev = evaluation(recipe, st, str(tdir) if tdir else None)
        entry = {"name": st.name, "kind": st.kind, "input": st.src or None, "output": st.dst or None,
                 **({"target": st.target} if getattr(st, "target", None) else {}),
                 "commands": [shlex.join(c) for c in commands(recipe, st, env)],
                 "evaluation": shlex.join(ev) if ev else None, "tokens": None, "tokens_formula": None}
        calib = stage_calibration(recipe, st, f"stages[{i}]")
        if calib is not None:
            c = entry["calibration"] = calibration_plan(calib, f"stages[{i}]", hasattr(st, "calib_seq_len"), lengths)
            entry.update(tokens=c["tokens"], tokens_formula=f"calibration {c['windows']} windows x {c['seq_len']}")
        if isinstance(st, SelfTextStage):
            t = st.settings
            entry.update(tokens=t.generated_tokens,
                         tokens_formula=f"written: {t.prompts} prompts x {t.new_tokens} new tokens")
        if isinstance(st, TrainStage):
            b = entry["budget"] = {k: v for k, v in st.budget.items() if k != "overrides"}
            entry.update(tokens=b["steps"] * b["global_batch"] * b["seq_len"],
                         tokens_formula=f"{b['steps']} steps x {b['global_batch']} x {b['seq_len']}")
            if shape is not None:
                cache = next((s for s in recipe.stages if s.name == st.teacher_cache), None)
                mem = estimate(shape, Budget(st.kind, b["local_batch"], b["seq_len"], b["dtype"], recipe.dp,
                                             par.device, b["activation_checkpoint"], b["fake_quant"],
                                             cache.top_k if cache is not None else 0))
                entry["memory_gib"] = {k: round(v / GIB, 2) for k, v in mem.items()}
                if par.device == "gpu" and par.gpu_memory_gib and mem["total"] / GIB > par.gpu_memory_gib:
                    out["notes"].append(f"stage {st.name}: estimated {mem['total'] / GIB:.1f} GiB per GPU "
                                        f"exceeds gpu_memory_gib = {par.gpu_memory_gib:g}")
        out["stages"].append(entry)
    return out


# ---- running -------------------------------------------------------------------------------------------
def wandb_identity(recipe: Recipe, st: Stage) -> dict[str, str]:
    """One wandb group per recipe run (recipe name + run directory), one run per stage: every process of
    the stage (training ranks, its evaluation) and a requeued job of it land in the same run."""
    where = hashlib.sha256(str(Path(recipe.run_dir).resolve()).encode()).hexdigest()[:8]
    group = re.sub(r"[^A-Za-z0-9_.-]", "-", f"{recipe.name}-{Path(recipe.run_dir).name}-{where}")
    return {"WANDB_RUN_GROUP": group, "WANDB_RUN_ID": f"{group}-{st.name}", "WANDB_RUN_NAME": st.name,
            "WANDB_RUN_JOB_TYPE": st.kind}



class StageFailed(Exception):
    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def _call(st: Stage, cmd: list[str], env: dict, capture: bool = False) -> str:
    print(f"$ {shlex.join(cmd)}", flush=True)
    i = cmd.index(PY)
    proc = subprocess.run([*cmd[:i], sys.executable, *cmd[i + 1:]], check=False, text=True, env=env,
                          stdout=subprocess.PIPE if capture else None)
    if proc.returncode:
        raise StageFailed(f"stage {st.name}: `{shlex.join(cmd[i:i + 3])}` exited with status "
                          f"{proc.returncode}", proc.returncode)
    return proc.stdout or ""


def run_stage(recipe: Recipe, st: Stage, env: dict) -> None:
    """Run one stage as child processes, skipping finished work as scripts/recipe.sh does."""
    print(f"== {st.name} [{st.kind}]", flush=True)
    env = {**wandb_identity(recipe, st), **env}  # what the user set wins
    if st.kind in TRAINING and recipe.parallelism.nodes > 1 and not env.get("SMELT_RDZV_ENDPOINT"):
        raise SmeltError(f"stage {st.name}: {recipe.parallelism.nodes} nodes need "
                         f"SMELT_RDZV_ENDPOINT=HOST:PORT")
    tdir = None
    if st.kind not in ("teacher", "verify", "report") and Path(st.dst).exists():
        print(f"skip: {st.dst} exists", flush=True)
    else:
        for need in st.needs():
            if need and need != recipe.teacher and not Path(need).exists():
                raise SmeltError(f"stage {st.name}: input {need} does not exist (run the stage that writes "
                                 f"it first)")
        src = metrics_source(recipe, st) if isinstance(st, ReleaseStage) and st.metrics else None
        if src is not None and not Path(recipe.evals(src)).is_file():
            raise SmeltError(f"stage {st.name}: {recipe.evals(src)} does not exist (evaluate {src} first)")
        for cmd in commands(recipe, st, env):
            text = _call(st, cmd, env, capture="models.teacher" in cmd)
            if "models.teacher" in cmd:
                tdir = text.strip().splitlines()[-1]
                print(tdir, flush=True)
        if st.kind in TRAINING and not Path(st.dst).is_dir():  # stopped by a signal, checkpointed
            raise StageFailed(f"stage {st.name}: training ended before its last step (checkpoint in "
                              f"{st.dst}-run); run the stage again to resume", 1)
    ev = evaluation(recipe, st, tdir)
    if ev is not None:
        out = ev[ev.index("--out") + 1]
        if Path(out).is_file():
            print(f"skip: {out} exists", flush=True)
        else:
            _call(st, ev, env)


def main(argv: list[str] | None = None) -> int | None:
    ap = ArgumentParser(prog="python -m configs.recipe", description=__doc__.split("\n")[0])
    ap.add_argument("recipe", help="a recipe TOML (configs/recipes/*.toml)")
    ap.add_argument("--dry-run", action="store_true", help="check and print the plan; run and write nothing")
    ap.add_argument("--json", help="with --dry-run: also write the plan as JSON to this file")
    ap.add_argument("--list-stages", action="store_true", help="print the stage names, one a line")
    ap.add_argument("--training-stages", action="store_true",
                    help="print the names of the stages that train (on every node), one a line")
    ap.add_argument("--stage", help="run (or plan) only this stage")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="change a value of the recipe, e.g. stages.recover.steps=2 (repeatable)")
    ap.add_argument("--teacher-config", help="config.json (or its directory) giving the plan's model shapes")
    args = ap.parse_args(argv)
    if args.json and not args.dry_run:
        raise SmeltError("--json needs --dry-run")
    recipe = load(args.recipe, args.set)
    names = [st.name for st in recipe.stages]
    if args.stage is not None and args.stage not in names:
        raise SmeltError(f"--stage {args.stage!r} is not a stage of {args.recipe} ({', '.join(names)})")
    if args.list_stages:
        print("\n".join(names))
        return None
    if args.training_stages:
        print("\n".join(st.name for st in recipe.stages if st.kind in TRAINING))
        return None
    if args.dry_run:
        shape = find_shape(recipe.teacher, recipe.teacher_config, args.teacher_config)
        p = plan(recipe, shape, dict(os.environ), args.stage)
        print(format_plan(p))
        if args.json:
            atomic_write_text(args.json, json.dumps(p, indent=2) + "\n")
        return None
    for st in recipe.stages:
        if args.stage in (None, st.name):
            try:
                run_stage(recipe, st, dict(os.environ))
            except StageFailed as e:
                print(f"error: {e}", file=sys.stderr)
                return e.status
    return None


if __name__ == "__main__":
    run_cli(main)
