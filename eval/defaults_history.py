"""docs/defaults-history.md's table: one row per change of the default recipe, its release's numbers read from the
committed reports of the run that measured it.

    python -m eval.defaults_history            # rewrite the table between the page's markers
    python -m eval.defaults_history --check    # exit 1 if the page differs from what results/ gives

The changes are kept by hand in results/defaults-history.toml, newest first:

    [[changes]]
    date = "2026-12-06"
    commit = "c093f64"                      # the commit that changed configs/recipes/smollm2-cpu.toml
    change = "QAT for 214 steps (was 192)"

    [[changes.measured]]                    # none: the change was not measured on its own
    folder = "current"                      # under results/: its qat-2of4.json (an eval.evaluate report)
    time = "current/chain24-time-v.txt"     # /usr/bin/time -v output, or a timeline/timing JSON
    scope = ""                              # what the time covers, when not the whole chain
    note = ""                               # shown beside the time (e.g. a shared machine)
    qat_longer = ["A.json#run", "B.json#run"]  # optional: the chain was timed with a shorter QAT stage;
                                            # add A's build-to-last-step seconds minus B's (an estimate)
    label = ""                              # a second measurement of the same change: what it was

Each measurement gives the release's en KL mean / P99, en PPL over the teacher's, needle retrieval at 2,048
tokens, the wall time and the machine (the report's `machine` record).
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

from configs.schema import read_toml
from core.errors import ArgumentParser, SmeltError, run_cli
from core.files import atomic_write_text, read_json
from eval.results_index import describe_machine

START, END = "<!-- defaults-history -->", "<!-- /defaults-history -->"
CHANGE_KEYS = {"date", "commit", "change", "measured"}
MEASURE_KEYS = {"folder", "time", "scope", "note", "qat_longer", "label"}
ELAPSED_RE = re.compile(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)")
MISSING = "–"


def _clock(text: str, where: str) -> float:
    try:
        parts = [float(p) for p in text.split(":")]
    except ValueError:
        raise SmeltError(f"{where}: elapsed time {text!r} is not [h:]mm:ss") from None
    seconds = 0.0
    for p in parts:
        seconds = seconds * 60 + p
    return seconds


def wall_seconds(path: Path) -> float:
    """The elapsed seconds a timing file records: /usr/bin/time -v output, a timeline or a timing JSON."""
    if not path.is_file():
        raise SmeltError(f"{path} does not exist (a timing file)")
    if path.suffix == ".txt":
        found = ELAPSED_RE.findall(path.read_text(encoding="utf-8"))
        if len(found) != 1:
            raise SmeltError(f"{path}: expected one 'Elapsed (wall clock)' line of /usr/bin/time -v, found {len(found)}")
        return _clock(found[0], str(path))
    data = read_json(path, "a timing JSON")
    if isinstance(data.get("time_v"), dict) and "elapsed" in data["time_v"]:
        return _clock(data["time_v"]["elapsed"], str(path))
    if "wall_seconds" in data:
        return float(data["wall_seconds"])
    for key in ("total_min_to_verified_release", "total_min"):
        if key in data:
            return 60.0 * float(data[key])
    raise SmeltError(f"{path}: no time_v.elapsed, wall_seconds or total_min")


def _trainer_seconds(results: Path, ref: str, where: str) -> float:
    file, _, run = ref.partition("#")
    data = read_json(results / file, "a step-times JSON")
    if not run:
        if len(data) != 1:
            raise SmeltError(f"{where}: {file} holds {len(data)} runs; name one as {file}#<run>")
        run = next(iter(data))
    if run not in data or "build_to_last_step_s" not in data[run]:
        raise SmeltError(f"{where}: {file} has no build_to_last_step_s for run {run!r}")
    return float(data[run]["build_to_last_step_s"])


def _fmt_clock(seconds: float) -> str:
    s = int(round(seconds))
    h, m, s = s // 3600, s // 60 % 60, s % 60
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def load_changes(path: Path) -> list[dict]:
    data = read_toml(path, "the default recipe's list of changes")
    if set(data) != {"changes"} or not isinstance(data["changes"], list) or not data["changes"]:
        raise SmeltError(f"{path}: expected a non-empty list of [[changes]] and nothing else")
    for i, c in enumerate(data["changes"], 1):
        where = f"{path} change {i}"
        unknown = set(c) - CHANGE_KEYS
        if unknown:
            raise SmeltError(f"{where}: unknown key(s) {sorted(unknown)} (allowed: {sorted(CHANGE_KEYS)})")
        for key in ("date", "commit", "change"):
            if not isinstance(c.get(key), str) or not c[key].strip():
                raise SmeltError(f"{where}: needs '{key}' (a string)")
        for j, m in enumerate(c.get("measured", []), 1):
            unknown = set(m) - MEASURE_KEYS
            if unknown:
                raise SmeltError(f"{where} measurement {j}: unknown key(s) {sorted(unknown)} "
                                 f"(allowed: {sorted(MEASURE_KEYS)})")
            if not isinstance(m.get("folder"), str):
                raise SmeltError(f"{where} measurement {j}: needs 'folder' (under results/)")
    return data["changes"]


def measure(results: Path, m: dict, where: str) -> dict:
    """One measurement's cells, read from results/<folder>/qat-2of4.json and its timing files."""
    report = read_json(results / m["folder"] / "qat-2of4.json", "an eval.evaluate report")
    en = report.get("buckets", {}).get("en")
    if not isinstance(en, dict):
        raise SmeltError(f"{results / m['folder'] / 'qat-2of4.json'}: no en bucket")
    needle = report.get("needle", {}).get("languages", {}).get("en", {}).get("by_length", {}).get("2048")
    cells = {"kl": f"{en['kl_mean']:.3f} / {en['kl_p99']:.2f}", "ppl": f"{en['ppl'] / en['teacher_ppl']:.2f}×",
             "needle": MISSING if needle is None else f"{100 * needle:.0f}%",
             "machine": describe_machine(report["machine"]) if isinstance(report.get("machine"), dict) else MISSING}
    time = MISSING
    if m.get("time"):
        seconds = wall_seconds(results / m["time"])
        if m.get("qat_longer"):
            longer, shorter = m["qat_longer"]
            extra = _trainer_seconds(results, longer, where) - _trainer_seconds(results, shorter, where)
            time = f"≈ {(seconds + extra) / 60:.0f} min (two runs)"
        else:
            time = _fmt_clock(seconds) + (f" ({m['scope']})" if m.get("scope") else "")
    if m.get("note"):
        time = m["note"] if time == MISSING else f"{time}; {m['note']}"
    cells["time"] = time
    cells["folder"] = f"[{m['folder']}](../results/{m['folder']}/)"
    return cells


def render_table(results: Path, changes: list[dict], where: Path) -> str:
    lines = ["| date | commit | what changed | release en KL mean / P99 | en PPL × teacher | needle at 2K | "
             "wall time | machine | results |",
             "|---|---|---|---:|---:|---:|---|---|---|"]
    for i, c in enumerate(changes, 1):
        measured = c.get("measured") or [None]
        for j, m in enumerate(measured):
            cells = (measure(results, m, f"{where} change {i}") if m else
                     {k: MISSING for k in ("kl", "ppl", "needle", "time", "machine")} | {"folder": "not measured"})
            head = (c["date"], f"`{c['commit']}`", c["change"]) if j == 0 else ("", "", m.get("label", ""))
            lines.append("| " + " | ".join(head + tuple(cells[k] for k in
                                                        ("kl", "ppl", "needle", "time", "machine", "folder")))
                         + " |")
    return "\n".join(lines)


def update_page(text: str, table: str, page: Path) -> str:
    if text.count(START) != 1 or text.count(END) != 1 or text.index(START) > text.index(END):
        raise SmeltError(f"{page}: needs {START} and {END} once each, in that order")
    head, rest = text.split(START)
    _, tail = rest.split(END)
    return f"{head}{START}\n{table}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m eval.defaults_history",
                        description="Render the default recipe's history table from results/defaults-history.toml.")
    ap.add_argument("--results", default="results", help="results folder (default: results)")
    ap.add_argument("--page", default="docs/defaults-history.md", help="the page holding the markers")
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if the page is stale")
    args = ap.parse_args(argv)
    results, page = Path(args.results), Path(args.page)
    if not page.is_file():
        raise SmeltError(f"{page} does not exist")
    source = results / "defaults-history.toml"
    table = render_table(results, load_changes(source), source)
    text = page.read_text(encoding="utf-8")
    new = update_page(text, table, page)
    if args.check:
        if new != text:
            print(f"{page} is stale: its table differs from {source} and the reports "
                  f"(run python -m eval.defaults_history)", file=sys.stderr)
            return 1
        print(f"{page} is up to date with {source}")
        return 0
    if new != text:
        atomic_write_text(page, new)
        print(f"wrote the table into {page}")
    else:
        print(f"{page} already up to date")
    return 0


if __name__ == "__main__":
    run_cli(main)
