"""The docs' result tables, generated from the committed evaluation reports with one command.

    python -m eval.tables                      # rewrite every table in README.md and docs/*.md from results/
    python -m eval.tables --check              # exit 1 naming each stale file and section
    python -m eval.tables docs/pruning.md ...  # only these markdown files (every section must be among them)

Layout (results/README.md has the long version):

    results/<section>/section.toml     what the table shows: rows in order (label, report file, the commands
                                       that made the artifact); a folder without one is not a section
    results/<section>/<row>.json       an eval.evaluate report (--out), committed as written

A section is rendered into exactly one markdown file of the list, between

    <!-- results:<section> -->
    <!-- /results:<section> -->

and nothing outside the markers is touched. A section with no markers in any file, markers in two files,
markers without a section, or a report in a section folder that section.toml does not list is a one-line
error naming the file and the section.

A section file (`render_section` renders one; `kind` picks how: "evaluations" when absent, or "chain", one chain's
headline table, eval.chain_table):

    buckets = ["en", "zh", "code"]               # optional: columns and their order (default: all, as found)

    [[rows]]
    label = "SparseGPT 2:4, en+code+zh calibration"
    file = "sparsegpt-2of4-mix.json"
    commands = ["python -m prune.run --method sparsegpt --pattern 2:4 --out runs/smollm2/sparsegpt-2of4-mix"]

The "evaluations" table has a row per report and, per bucket, PPL, KL mean, KL P99 and top-1 agreement; under
it a line naming the machine(s) and evaluation windows, and the commands of every row (the artifact's, from
section.toml, then the evaluation's, from the report).
"""
from __future__ import annotations

import itertools
import json
import re
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path

from core.errors import ArgumentParser, SmeltError, run_cli
from core.files import atomic_write_text, read_json
from eval import chain_table

SECTION_FILES = ("section.toml", "section.json")
SECTION_KEYS = {"kind", "rows", "buckets"}
ROW_KEYS = {"label", "file", "commands"}
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
MARKER_RE = re.compile(r"<!-- /?results:([^ >]*) -->")
# (column header, metric key, format) per bucket
METRICS = (("PPL", "ppl", "{:.2f}"), ("KL mean", "kl_mean", "{:.3f}"), ("KL P99", "kl_p99", "{:.3f}"),
           ("top-1", "top1_agree", "{:.3f}"))
MISSING = "–"


def start_marker(section: str) -> str:
    return f"<!-- results:{section} -->"


def end_marker(section: str) -> str:
    return f"<!-- /results:{section} -->"


def one_line_msg(e: Exception) -> str:
    return " ".join(str(e).split())


def default_files() -> list[Path]:
    """README.md and every docs/*.md, from the current directory."""
    return [Path("README.md"), *sorted(Path("docs").glob("*.md"))]


# --- a section: its folder and its spec ---------------------------------------------------------------------

def section_file(folder: Path) -> Path | None:
    """The folder's section.toml or section.json; None if it has neither (not a section)."""
    found = [folder / n for n in SECTION_FILES if (folder / n).is_file()]
    if len(found) > 1:
        raise SmeltError(f"results section {folder.name}: {folder} has both section.toml and section.json")
    return found[0] if found else None


def read_spec(path: Path) -> dict:
    try:
        if path.suffix == ".toml":
            spec = tomllib.loads(path.read_text(encoding="utf-8"))
        else:
            spec = json.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise SmeltError(f"{path} does not parse ({one_line_msg(e)})") from None
    if not isinstance(spec, dict):
        raise SmeltError(f"{path}: expected a table with 'rows'")
    return spec


def find_sections(results: Path) -> dict[str, tuple[Path, dict]]:
    """{name: (folder, spec)} of every folder of `results` that holds a section file."""
    if not results.is_dir():
        raise SmeltError(f"results folder {results} does not exist")
    sections = {}
    for folder in sorted(p for p in results.iterdir() if p.is_dir() and not p.name.startswith(".")):
        path = section_file(folder)
        if path is None:
            continue  # benchmark outputs, evidence folders: cited by the docs, not rendered as tables
        if not NAME_RE.fullmatch(folder.name):
            raise SmeltError(f"results section {folder.name!r}: names are letters, digits, '_', '-', '.'")
        sections[folder.name] = (folder, read_spec(path))
    if not sections:
        raise SmeltError(f"{results} has no sections (folders with a section.toml)")
    return sections


def _as_commands(value, where: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(c, str) for c in value):
        return list(value)
    raise SmeltError(f"{where}: 'commands' must be a string or a list of strings")


def load_evaluations(folder: Path, spec: dict, where: Path, needs: str = "buckets",
                     what: str = "an eval.evaluate report") -> dict:
    """An "evaluations" section: buckets (or None) and rows [{label, file, commands, report}], in file order;
    every report a JSON object holding `needs` (another kind's reports: `what` they are)."""
    unknown = set(spec) - SECTION_KEYS
    if unknown:
        raise SmeltError(f"{where}: unknown key(s) {sorted(unknown)} (allowed: {sorted(SECTION_KEYS)})")
    rows_spec = spec.get("rows")
    if not isinstance(rows_spec, list) or not rows_spec:
        raise SmeltError(f"{where}: needs a non-empty list of rows ([[rows]] with label and file)")
    buckets = spec.get("buckets")
    if buckets is not None and (not isinstance(buckets, list) or not all(isinstance(b, str) for b in buckets)):
        raise SmeltError(f"{where}: 'buckets' must be a list of bucket names")
    rows, seen = [], set()
    for i, r in enumerate(rows_spec, 1):
        at = f"{where} row {i}"
        if not isinstance(r, dict):
            raise SmeltError(f"{at}: expected a table with label, file and commands")
        unknown = set(r) - ROW_KEYS
        if unknown:
            raise SmeltError(f"{at}: unknown key(s) {sorted(unknown)} (allowed: {sorted(ROW_KEYS)})")
        label, file = r.get("label"), r.get("file")
        if not isinstance(label, str) or not label.strip():
            raise SmeltError(f"{at}: needs a 'label'")
        if not isinstance(file, str) or not file.endswith(".json") or "/" in file or "\\" in file:
            raise SmeltError(f"{at}: 'file' must name a .json report in {folder} (no directories)")
        if file in seen:
            raise SmeltError(f"{at}: {file} is listed twice")
        seen.add(file)
        report_path = folder / file
        if not report_path.is_file():
            raise SmeltError(f"{at}: {report_path} does not exist")
        report = read_json(report_path, what)
        if not isinstance(report, dict) or not isinstance(report.get(needs), dict):
            raise SmeltError(f"{report_path} has no {needs!r} (not {what}?)")
        rows.append({"label": label.strip(), "file": file, "report": report,
                     "commands": _as_commands(r.get("commands", []), at)})
    # every report in the folder is shown, so no measured number is left out of the docs by accident
    unlisted = sorted(p.name for p in folder.glob("*.json") if p.name not in seen and p.name not in SECTION_FILES)
    if unlisted:
        raise SmeltError(f"results section {folder.name}: {', '.join(unlisted)} not listed in {where.name}")
    return {"buckets": buckets, "rows": rows}


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _machine_line(machine: dict | None) -> str:
    if not machine:
        return "machine not recorded"
    threads = machine.get("torch_threads")
    parts = [f"measured on {machine.get('cpu') or 'unknown CPU'}"]
    if machine.get("gpu"):
        parts[0] += f" + {machine['gpu']}"
    if threads is not None:
        parts.append(f"{threads} threads")
    if machine.get("torch"):
        parts.append(f"torch {machine['torch']}")
    return ", ".join(parts)


def _windows_line(settings: dict | None) -> str:
    if not settings or "windows" not in settings:
        return "evaluation windows not recorded"
    win = " / ".join(f"{b} {n}" for b, n in settings["windows"].items())
    seq = settings.get("seq_len")
    return f"evaluation windows {win}" + (f" × {seq} tokens" if seq else "")


def _grouped(rows: list[dict], describe) -> str:
    """One clause when all rows agree, else one per distinct value naming its rows."""
    groups: dict[str, list[str]] = {}
    for r in rows:
        groups.setdefault(describe(r), []).append(r["label"])
    if len(groups) == 1:
        return next(iter(groups))
    return "; ".join(f"{text} ({', '.join(labels)})" for text, labels in groups.items())


def render_evaluations(name: str, section: dict) -> str:
    """The markdown of an "evaluations" section: table, machine/windows line, commands."""
    rows = section["rows"]
    buckets = section["buckets"] or list(dict.fromkeys(b for r in rows for b in r["report"]["buckets"]))
    head = ["model"] + [f"{b} {metric}" for b in buckets for metric, _, _ in METRICS]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for r in rows:
        cells = [_cell(r["label"])]
        for b in buckets:
            m = r["report"]["buckets"].get(b, {})
            for _, key, fmt in METRICS:
                v = m.get(key)
                cells.append(fmt.format(v) if isinstance(v, (int, float)) else MISSING)
        lines.append("| " + " | ".join(cells) + " |")
    machine = _grouped(rows, lambda r: _machine_line(r["report"].get("machine")))
    windows = _grouped(rows, lambda r: _windows_line(r["report"].get("settings")))
    footnote = (f"{machine[0].upper()}{machine[1:]}; {windows}. Generated by `python -m eval.tables` from "
                f"`results/{name}/`; commands:")
    lines += ["", footnote, "", "```bash"]
    for r in rows:
        lines.append(f"# {r['label']}")
        lines += r["commands"]
        lines.append(r["report"].get("command") or "# (evaluation command not recorded in the report)")
    lines.append("```")
    return "\n".join(lines)


def render_peak_memory(name: str, section: dict) -> str:
    """The markdown of a "peak-memory" section (qat.release_memory reports): each command's peak resident set,
    the limit it is held to, wall time and exit status, then the machine line and the commands."""
    lines = ["| model | command | peak RSS | limit | wall time | exit |", "|---|---|---:|---:|---:|---:|"]
    for r in section["rows"]:
        rep = r["report"]
        for run in rep["runs"].values():
            rss = run.get("max_rss_bytes")
            lines.append(f"| {_cell(r['label'])} | `{_cell(run['command'].split()[0])}` | "
                         f"{f'{rss / 2**30:.2f} GiB' if rss else MISSING} | {rep['limit_bytes'] / 2**30:.1f} GiB | "
                         f"{run['wall_s'] / 60:.1f} min | {run['exit_status']} |")
    machine = _grouped(section["rows"], lambda r: _machine_line(r["report"].get("machine")))
    lines += ["", f"{machine[0].upper()}{machine[1:]}; `/usr/bin/time -v`'s maximum resident set size. Generated by "
              f"`python -m eval.tables` from `results/{name}/`; commands:", "", "```bash"]
    for r in section["rows"]:
        lines += [f"# {r['label']}", *r["commands"]]
    lines.append("```")
    return "\n".join(lines)


# kind -> how a section of that kind is read and rendered: (folder, spec, section file) -> markdown
KINDS: dict[str, Callable[[Path, dict, Path], str]] = {
    "evaluations": lambda folder, spec, where: render_evaluations(folder.name, load_evaluations(folder, spec, where)),
    "chain": lambda folder, spec, where: chain_table.render_chain(folder.name,
                                                                  chain_table.load_chain(folder, spec, str(where))),
    "peak-memory": lambda folder, spec, where: render_peak_memory(folder.name, load_evaluations(
        folder, spec, where, needs="runs", what="a qat.release_memory report")),
}


def render_section(folder: Path, spec: dict) -> str:
    """The generated markdown of one section, from its folder and its spec (section.toml's contents)."""
    where = section_file(folder) or folder / SECTION_FILES[0]
    kind = spec.get("kind", "evaluations")
    if kind not in KINDS:
        raise SmeltError(f"{where}: kind {kind!r} is not one of {', '.join(sorted(KINDS))}")
    return KINDS[kind](folder, spec, where)


# --- the markdown files ---------------------------------------------------------------------------------------

def _marker_span(text: str, section: str, path: Path) -> tuple[int, int]:
    """Offsets of the text between a section's markers (after the start marker, up to the end marker)."""
    start, end = start_marker(section), end_marker(section)
    n_start, n_end = text.count(start), text.count(end)
    if n_start == 0 or n_end == 0:
        raise SmeltError(f"{path} has {start if n_start else end} without its {end if n_start else start} "
                         f"for results section {section}")
    if n_start > 1 or n_end > 1:
        raise SmeltError(f"{path} has results section {section}'s markers more than once")
    i, j = text.index(start) + len(start), text.index(end)
    if j < i:
        raise SmeltError(f"{path}: {end} comes before {start}")
    return i, j


def place_sections(texts: dict[Path, str], names: set[str]) -> dict[Path, list[str]]:
    """{file: the sections whose markers it holds}; every section in exactly one file, every marker a section."""
    where: dict[str, list[Path]] = {}
    for path, text in texts.items():
        found = set(MARKER_RE.findall(text))
        orphans = sorted(found - names)
        if orphans:
            raise SmeltError(f"{path} has markers for results section {orphans[0]}, which has no "
                             f"results/{orphans[0]}/section.toml")
        for name in found:
            where.setdefault(name, []).append(path)
    for name in sorted(names):
        paths = where.get(name, [])
        if not paths:
            looked = ", ".join(str(p) for p in texts) or "no files"
            raise SmeltError(f"no markdown file has {start_marker(name)} ... {end_marker(name)} markers for "
                             f"results section {name} (looked in {looked})")
        if len(paths) > 1:
            raise SmeltError(f"results section {name} has markers in both {paths[0]} and {paths[1]}: a section "
                             f"is rendered in one file")
    placed: dict[Path, list[str]] = {path: [] for path in texts}
    for name in sorted(names):
        placed[where[name][0]].append(name)
    return placed


def update_text(text: str, rendered: dict[str, str], path: Path) -> str:
    """The file's text with each of `rendered`'s sections between its markers."""
    spans = sorted((*_marker_span(text, name, path), name) for name in rendered)
    for (_, j, a), (i, _, b) in itertools.pairwise(spans):
        if i < j:
            raise SmeltError(f"{path}: the markers of results sections {a} and {b} overlap")
    out, pos = [], 0
    for i, j, name in spans:
        out += [text[pos:i], "\n", rendered[name], "\n"]
        pos = j
    out.append(text[pos:])
    return "".join(out)


def _between(text: str, section: str) -> str:
    return text[text.index(start_marker(section)):text.index(end_marker(section))]


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m eval.tables",
                        description="Render each results/<section>/ between its <!-- results:<section> --> markers "
                                    "in the markdown files (each section in exactly one of them).")
    ap.add_argument("files", nargs="*", type=Path,
                    help="markdown files holding the markers (default: README.md and docs/*.md)")
    ap.add_argument("--results", default="results", help="results folder (default: results)")
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a file is not up to date")
    args = ap.parse_args(argv)
    files = list(dict.fromkeys(args.files or default_files()))
    for path in files:
        if not path.is_file():
            raise SmeltError(f"{path} does not exist")
    sections = find_sections(Path(args.results))
    rendered = {name: render_section(folder, spec) for name, (folder, spec) in sections.items()}
    texts = {path: path.read_text(encoding="utf-8") for path in files}
    placed = place_sections(texts, set(sections))
    new = {path: update_text(texts[path], {n: rendered[n] for n in names}, path) for path, names in placed.items()}
    if args.check:
        stale = {path: [n for n in names if _between(new[path], n) != _between(texts[path], n)]
                 for path, names in placed.items()}
        stale = {path: names for path, names in stale.items() if names}
        for path, names in stale.items():
            print(f"{path} is stale: results section(s) {', '.join(names)} differ from {args.results}/ "
                  f"(run python -m eval.tables)", file=sys.stderr)
        if stale:
            return 1
        print(f"{len(sections)} section(s) up to date with {args.results}/ in {len(files)} file(s)")
        return 0
    written = [path for path in files if new[path] != texts[path]]
    for path in written:
        atomic_write_text(path, new[path])
        print(f"wrote {path}: {', '.join(placed[path])}")
    if not written:
        print(f"{len(sections)} section(s) already up to date in {len(files)} file(s)")
    return 0


if __name__ == "__main__":
    run_cli(main)
