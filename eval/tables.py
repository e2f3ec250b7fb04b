"""The README's result tables, generated from the committed evaluation reports with one command.

    python -m eval.tables                        # rewrite README.md's tables from results/
    python -m eval.tables --check                # exit 1 if README.md differs from what results/ gives
    python -m eval.tables --results results --readme README.md

Layout (results/README.md has the long version):

    results/<section>/section.toml     rows in order: label, report file, the commands that made the artifact
    results/<section>/<row>.json       an eval.evaluate report (--out), committed as written

Each section becomes one markdown table (a row per report; per bucket: PPL, KL mean, KL P99, top-1
agreement), a line naming the machine(s) and evaluation windows, and the commands of every row (the
artifact's, from section.toml, then the evaluation's, from the report). It replaces what lies between

    <!-- results:<section> -->
    <!-- /results:<section> -->

in the README; nothing outside the markers is touched. A section without markers, markers without a
section, or a report in a section folder that section.toml does not list is a one-line error.

A section file:

    buckets = ["en", "zh", "code"]               # optional: columns and their order (default: all, as found)

    [[rows]]
    label = "SparseGPT 2:4, en+code+zh calibration"
    file = "sparsegpt-2of4-mix.json"
    commands = ["python -m prune.run --method sparsegpt --pattern 2:4 --out runs/smollm2/sparsegpt-2of4-mix"]
"""
from __future__ import annotations

import itertools
import json
import re
import sys
import tomllib
from pathlib import Path

from core.errors import ArgumentParser, SmeltError, run_cli
from core.files import atomic_write_text, read_json

SECTION_FILES = ("section.toml", "section.json")
NOT_SECTIONS = ("bench",)  # results/bench/: benchmark outputs (speed, memory, GPU smoke), not README tables
SECTION_KEYS = {"rows", "buckets"}
ROW_KEYS = {"label", "file", "commands"}
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
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


def _read_section_file(path: Path) -> dict:
    try:
        if path.suffix == ".toml":
            return tomllib.loads(path.read_text(encoding="utf-8"))
        return json.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise SmeltError(f"{path} does not parse ({one_line_msg(e)})") from None


def _as_commands(value, where: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(c, str) for c in value):
        return list(value)
    raise SmeltError(f"{where}: 'commands' must be a string or a list of strings")


def load_section(folder: Path) -> dict:
    """A section: its name, buckets (or None) and rows [{label, file, commands, report}], in file order."""
    found = [folder / n for n in SECTION_FILES if (folder / n).is_file()]
    if len(found) != 1:
        what = "both section.toml and section.json" if found else "no section.toml or section.json"
        raise SmeltError(f"results section {folder.name}: {folder} has {what}")
    path = found[0]
    spec = _read_section_file(path)
    if not isinstance(spec, dict):
        raise SmeltError(f"{path}: expected a table with 'rows'")
    unknown = set(spec) - SECTION_KEYS
    if unknown:
        raise SmeltError(f"{path}: unknown key(s) {sorted(unknown)} (allowed: {sorted(SECTION_KEYS)})")
    rows_spec = spec.get("rows")
    if not isinstance(rows_spec, list) or not rows_spec:
        raise SmeltError(f"{path}: needs a non-empty list of rows ([[rows]] with label and file)")
    buckets = spec.get("buckets")
    if buckets is not None and (not isinstance(buckets, list) or not all(isinstance(b, str) for b in buckets)):
        raise SmeltError(f"{path}: 'buckets' must be a list of bucket names")
    rows, seen = [], set()
    for i, r in enumerate(rows_spec, 1):
        where = f"{path} row {i}"
        if not isinstance(r, dict):
            raise SmeltError(f"{where}: expected a table with label, file and commands")
        unknown = set(r) - ROW_KEYS
        if unknown:
            raise SmeltError(f"{where}: unknown key(s) {sorted(unknown)} (allowed: {sorted(ROW_KEYS)})")
        label, file = r.get("label"), r.get("file")
        if not isinstance(label, str) or not label.strip():
            raise SmeltError(f"{where}: needs a 'label'")
        if not isinstance(file, str) or not file.endswith(".json") or "/" in file or "\\" in file:
            raise SmeltError(f"{where}: 'file' must name a .json report in {folder} (no directories)")
        if file in seen:
            raise SmeltError(f"{where}: {file} is listed twice")
        seen.add(file)
        report_path = folder / file
        if not report_path.is_file():
            raise SmeltError(f"{where}: {report_path} does not exist")
        report = read_json(report_path, "an eval.evaluate report")
        if not isinstance(report, dict) or not isinstance(report.get("buckets"), dict):
            raise SmeltError(f"{report_path} has no 'buckets' (not an eval.evaluate report?)")
        rows.append({"label": label.strip(), "file": file, "report": report,
                     "commands": _as_commands(r.get("commands", []), where)})
    unlisted = sorted(p.name for p in folder.glob("*.json") if p.name not in seen and p.name not in SECTION_FILES)
    if unlisted:
        raise SmeltError(f"results section {folder.name}: {', '.join(unlisted)} not listed in {path.name}")
    return {"name": folder.name, "buckets": buckets, "rows": rows}


def load_sections(results: Path) -> dict[str, dict]:
    if not results.is_dir():
        raise SmeltError(f"results folder {results} does not exist")
    sections = {}
    for folder in sorted(p for p in results.iterdir() if p.is_dir() and not p.name.startswith(".")
                         and p.name not in NOT_SECTIONS):
        if not NAME_RE.fullmatch(folder.name):
            raise SmeltError(f"results section {folder.name!r}: names are letters, digits, '_', '-', '.'")
        sections[folder.name] = load_section(folder)
    if not sections:
        raise SmeltError(f"{results} has no sections (folders with a section.toml)")
    return sections


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


def render_section(section: dict) -> str:
    """The markdown of one section: table, machine/windows line, commands."""
    rows = section["rows"]
    buckets = section["buckets"] or list(dict.fromkeys(b for r in rows for b in r["report"]["buckets"]))
    head = ["model"] + [f"{b} {name}" for b in buckets for name, _, _ in METRICS]
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
                f"`results/{section['name']}/`; commands:")
    lines += ["", footnote, "", "```bash"]
    for r in rows:
        lines.append(f"# {r['label']}")
        lines += r["commands"]
        lines.append(r["report"].get("command") or "# (evaluation command not recorded in the report)")
    lines.append("```")
    return "\n".join(lines)


def _marker_span(text: str, section: str, readme: Path) -> tuple[int, int]:
    """Offsets of the text between a section's markers (after the start marker's line, up to the end marker)."""
    start, end = start_marker(section), end_marker(section)
    n_start, n_end = text.count(start), text.count(end)
    if n_start == 0 or n_end == 0:
        raise SmeltError(f"{readme} has no {start} ... {end} markers for results section {section}")
    if n_start > 1 or n_end > 1:
        raise SmeltError(f"{readme} has results section {section}'s markers more than once")
    i, j = text.index(start) + len(start), text.index(end)
    if j < i:
        raise SmeltError(f"{readme}: {end} comes before {start}")
    return i, j


def update_readme(text: str, sections: dict[str, dict], readme: Path) -> str:
    """The README text with every section's generated markdown between its markers."""
    known = set(re.findall(r"<!-- /?results:([^ >]*) -->", text))
    orphans = sorted(known - set(sections))
    if orphans:
        raise SmeltError(f"{readme} has markers for results section {orphans[0]}, which has no "
                         f"results/{orphans[0]}/section.toml")
    spans = sorted((*_marker_span(text, name, readme), name) for name in sections)
    for (_, j, a), (i, _, b) in itertools.pairwise(spans):
        if i < j:
            raise SmeltError(f"{readme}: the markers of results sections {a} and {b} overlap")
    out, pos = [], 0
    for i, j, name in spans:
        out += [text[pos:i], "\n", render_section(sections[name]), "\n"]
        pos = j
    out.append(text[pos:])
    return "".join(out)


def _between(text: str, section: str) -> str:
    return text[text.index(start_marker(section)):text.index(end_marker(section))]


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m eval.tables",
                        description="Render results/<section>/ into README.md between <!-- results:<section> --> markers.")
    ap.add_argument("--results", default="results", help="results folder (default: results)")
    ap.add_argument("--readme", default="README.md", help="markdown file holding the markers (default: README.md)")
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if the README is not up to date")
    args = ap.parse_args(argv)
    readme = Path(args.readme)
    if not readme.is_file():
        raise SmeltError(f"{readme} does not exist")
    sections = load_sections(Path(args.results))
    text = readme.read_text(encoding="utf-8")
    new = update_readme(text, sections, readme)
    if args.check:
        stale = [name for name in sections if _between(new, name) != _between(text, name)]
        if stale:
            print(f"{readme} is stale: results section(s) {', '.join(stale)} differ from {args.results}/ "
                  f"(run python -m eval.tables)", file=sys.stderr)
            return 1
        print(f"{readme} is up to date with {args.results}/ ({len(sections)} section(s))")
        return 0
    if new != text:
        atomic_write_text(readme, new)
        print(f"wrote {len(sections)} section(s) into {readme}: {', '.join(sections)}")
    else:
        print(f"{readme} already up to date ({len(sections)} section(s))")
    return 0


if __name__ == "__main__":
    run_cli(main)
