"""results/INDEX.md: every results folder with the question it answers, its date, machine, commit, status and
the pages that cite it, generated from results/index.toml and the files themselves.

    python -m eval.results_index            # write results/INDEX.md
    python -m eval.results_index --check    # change nothing; exit 1 with one line per problem
    python -m eval.results_index --stamp    # fill each entry's missing commit and date from git history

An entry is a folder directly under results/ (but results/bench/ itself), or a folder or file directly under
results/bench/. What cannot be read off the files is kept by hand in results/index.toml:

    ["bench/recipe-bf16"]
    question = "What does the chain give with bf16 calibration forwards, recovery and QAT?"
    status = "superseded"          # current | superseded | negative result
    date = "2026-12-01"            # when it was measured
    commit = "bd70f80"             # the commit that added it (--stamp fills it)
    machine = "..."                # only where no JSON in the entry records a `machine`

The machine comes from the `machine` records of the entry's JSONs (CPU and cores, GPU if any); the citing pages
are README.md, docs/**/*.md and the top-level folders' README.md (experiments/, slurm/, ...), scanned for
`results/<entry>` paths. The check fails on a stale INDEX.md, an
entry no page cites, a page citing an entry (or linking a file) that does not exist, and an entry missing from
index.toml or described there incompletely. `--stamp` asks git, so only it needs the history; the check does not.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from configs.schema import read_toml
from core.errors import ArgumentParser, SmeltError, run_cli
from core.files import atomic_write_text

STATUSES = ("current", "superseded", "negative result")
KEYS = ("question", "status", "date", "commit", "machine")
REQUIRED = ("question", "status", "date", "commit")
# results/'s own files: not entries
OWN_FILES = {"README.md", "INDEX.md", "index.toml", "defaults-history.toml"}
DATE_RE = re.compile(r"\d{4}-\d{2}-\d{2}")
CITE_RE = re.compile(r"(?<![\w/.-])(?:\.\./)*results/((?:bench/)?[\w.-]+)((?:/[\w.*{},<>-]+)*)/?")
LINK_RE = re.compile(r"\]\(((?:\.\./)*results/[^)#\s]+)")
TOML_HEADER = """\
# The hand-kept half of results/INDEX.md (python -m eval.results_index renders it; --check runs in the tests).
# One table per results entry: a folder directly under results/, or a folder or file directly under
# results/bench/. question: what it answers; status: current | superseded | negative result; date: when it
# was measured; commit: the commit that added it (python -m eval.results_index --stamp fills missing ones
# from git); machine: only where no JSON in the entry records one. --stamp rewrites this file: keep
# comments in this header.
"""


def _entry_sort_key(name: str) -> tuple[int, str]:
    return (name.startswith("bench/"), name)


def entries(results: Path) -> list[str]:
    """Entry names relative to results/, e.g. "current", "bench/recipe-bf16", "bench/load-rss.json"."""
    if not results.is_dir():
        raise SmeltError(f"results folder {results} does not exist")
    names = []
    for p in results.iterdir():
        if p.name.startswith(".") or p.name in OWN_FILES:
            continue
        if p.name == "bench" and p.is_dir():
            names += [f"bench/{q.name}" for q in p.iterdir() if not q.name.startswith(".")]
        else:
            names.append(p.name)
    return sorted(names, key=_entry_sort_key)


def load_index(path: Path) -> dict[str, dict]:
    data = read_toml(path, "the results index's hand-kept half")
    for name, spec in data.items():
        if not isinstance(spec, dict):
            raise SmeltError(f"{path}: {name!r} must be a table ([\"{name}\"] with question, status, ...)")
        for key, value in spec.items():
            if key not in KEYS:
                raise SmeltError(f"{path}: [{name!r}] unknown key {key!r} (allowed: {', '.join(KEYS)})")
            if not isinstance(value, str):
                raise SmeltError(f"{path}: [{name!r}] {key} must be a string")
    return data


def _machines_in(obj, out: set[str]) -> None:
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key == "machine" and isinstance(value, dict) and value.get("cpu"):
                out.add(describe_machine(value))
            else:
                _machines_in(value, out)
    elif isinstance(obj, list):
        for value in obj:
            _machines_in(value, out)


def describe_machine(m: dict) -> str:
    cpu = re.sub(r"\((?:R|TM)\)", "", str(m["cpu"])).replace(" Processor", "")
    text = " ".join(cpu.split())
    if m.get("cpu_count"):
        text += f", {m['cpu_count']} cores"
    if m.get("gpu"):
        text += f", {m['gpu']}"
    return text


def machine_of(results: Path, entry: str) -> str:
    """The machines the entry's JSONs record, joined; '' when none records one."""
    path = results / entry
    files = [path] if path.is_file() else sorted(path.rglob("*.json"))
    found: set[str] = set()
    for f in files:
        if f.suffix != ".json" or not f.exists():  # a broken link is reported by the check
            continue
        try:
            data = json.loads(f.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SmeltError(f"{f} is not valid JSON ({e})") from None
        _machines_in(data, found)
    return "; ".join(sorted(found))


def pages(root: Path) -> list[Path]:
    """README.md, docs/**/*.md and the README.md of each top-level folder (experiments/, slurm/, ...)."""
    found = [root / "README.md"] if (root / "README.md").is_file() else []
    found += sorted((root / "docs").rglob("*.md")) if (root / "docs").is_dir() else []
    return found + sorted(p for p in root.glob("*/README.md")
                          if p.parent.name not in ("docs", "results") and not p.parent.name.startswith("."))


def citations(root: Path) -> tuple[dict[str, list[str]], list[tuple[str, int, str]], list[tuple[str, int, str]]]:
    """({entry: [pages citing it]}, [(page, line, entry) cited], [(page, line, link target)] of markdown links)."""
    cited: dict[str, list[str]] = {}
    mentions, links = [], []
    for page in pages(root):
        rel = page.relative_to(root).as_posix()
        for lineno, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            for m in CITE_RE.finditer(line):
                entry = m.group(1).rstrip(".")
                if entry in OWN_FILES or entry == "bench" or line[m.end(1):m.end(1) + 1] in ("*", "{", "<", "["):
                    continue  # a pattern (results/bench/oneshot-*), not a path
                mentions.append((rel, lineno, entry))
                if rel not in cited.setdefault(entry, []):
                    cited[entry].append(rel)
            for m in LINK_RE.finditer(line):
                links.append((rel, lineno, m.group(1)))
    return cited, mentions, links


def build_rows(results: Path, root: Path, index: dict[str, dict]) -> list[dict]:
    cited, _, _ = citations(root)
    rows = []
    for name in entries(results):
        spec = index.get(name, {})
        rows.append({"entry": name, "question": spec.get("question", ""), "status": spec.get("status", ""),
                     "date": spec.get("date", ""), "commit": spec.get("commit", ""),
                     "machine": machine_of(results, name) or spec.get("machine", ""),
                     "pages": cited.get(name, [])})
    return rows


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ") or "–"


def render(rows: list[dict]) -> str:
    counts = {s: sum(r["status"] == s for r in rows) for s in STATUSES}
    lines = [
        "# Results index",
        "",
        "Every folder of measurements under `results/`: the question it answers, when and where it was measured,",
        "the commit that added it, whether it still describes the code, and the pages that cite it. Generated by",
        "`python -m eval.results_index` from `results/index.toml` and the files themselves; `--check` (run by the",
        "tests) fails when this page is stale, when no page cites a folder, or when a page cites one that is missing.",
        "",
        "Status: **current**: what the code and the default recipe do now; **superseded**: an earlier default or",
        "setting, kept because a page draws on it; **negative result**: a lever measured and not adopted.",
        f"{len(rows)} entries: {counts['current']} current, {counts['superseded']} superseded, "
        f"{counts['negative result']} negative results.",
        "",
        "| folder | question it answers | date | machine | commit | status | cited by |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        target = r["entry"] + ("/" if "." not in r["entry"].rsplit("/", 1)[-1] else "")
        cites = ", ".join(f"[{p}](../{p})" for p in r["pages"])
        lines.append(f"| [{r['entry']}]({target}) | {_cell(r['question'])} | {_cell(r['date'])} | "
                     f"{_cell(r['machine'])} | {_cell(r['commit'])} | {_cell(r['status'])} | {_cell(cites)} |")
    return "\n".join(lines) + "\n"


def problems(results: Path, root: Path, index: dict[str, dict], index_path: Path) -> list[str]:
    """One line per problem; empty when INDEX.md, index.toml, the folders and the pages agree."""
    out = []
    names = entries(results)
    cited, mentions, links = citations(root)
    rel_results = results.relative_to(root).as_posix() if results.is_relative_to(root) else str(results)
    for name in names:
        spec = index.get(name)
        if spec is None:
            out.append(f"{rel_results}/{name}: not in {index_path.name} (add its question, status, date, commit)")
            continue
        missing = [k for k in REQUIRED if not spec.get(k, "").strip()]
        if missing:
            out.append(f"{index_path.name} [{name!r}]: needs {', '.join(missing)}")
        if spec.get("status") and spec["status"] not in STATUSES:
            out.append(f"{index_path.name} [{name!r}]: status {spec['status']!r} is not one of {', '.join(STATUSES)}")
        if spec.get("date") and not DATE_RE.fullmatch(spec["date"]):
            out.append(f"{index_path.name} [{name!r}]: date {spec['date']!r} is not YYYY-MM-DD")
        if spec.get("machine") and machine_of(results, name):
            out.append(f"{index_path.name} [{name!r}]: machine is recorded in its JSONs; remove it here")
        if name not in cited:
            out.append(f"{rel_results}/{name}: no page cites it (README.md, docs/*.md, <folder>/README.md)")
        path = results / name
        for link in sorted(p for p in ([path] if path.is_file() else path.rglob("*")) if p.is_symlink()):
            if not link.exists():
                out.append(f"{link.relative_to(results.parent).as_posix()}: links {os.readlink(link)}, "
                           f"which does not exist")
    for name in sorted(set(index) - set(names), key=_entry_sort_key):
        out.append(f"{index_path.name} [{name!r}]: {rel_results}/{name} does not exist")
    for page, lineno, entry in mentions:
        if entry not in names:
            out.append(f"{page}:{lineno}: cites {rel_results}/{entry}, which does not exist")
    for page, lineno, target in links:
        if not (root / page).parent.joinpath(target).exists():
            out.append(f"{page}:{lineno}: links {target}, which does not exist")
    index_md = results / "INDEX.md"
    text = render(build_rows(results, root, index))
    if not index_md.is_file() or index_md.read_text(encoding="utf-8") != text:
        out.append(f"{rel_results}/INDEX.md is stale (run python -m eval.results_index)")
    return out


def _toml_str(value: str) -> str:
    return json.dumps(value, ensure_ascii=False)  # a JSON string is a valid TOML basic string


def render_index_toml(index: dict[str, dict]) -> str:
    parts = [TOML_HEADER]
    for name in sorted(index, key=_entry_sort_key):
        parts.append(f"\n[{_toml_str(name)}]\n")
        parts += [f"{k} = {_toml_str(index[name][k])}\n" for k in KEYS if k in index[name]]
    return "".join(parts)


def _git(root: Path, *args: str) -> str:
    proc = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SmeltError(f"git {' '.join(args[:2])} failed in {root}: {' '.join(proc.stderr.split())}")
    return proc.stdout


def stamp(results: Path, root: Path, index: dict[str, dict]) -> list[str]:
    """Fill each entry's missing commit (the first that added a file under it) and date; returns the entries."""
    filled = []
    for name in entries(results):
        spec = index.get(name)
        if spec is None or spec.get("commit"):
            continue
        rel = (results / name).relative_to(root).as_posix()
        log = _git(root, "log", "--diff-filter=A", "--format=%h %ad", "--date=short", "--", rel).split("\n")
        added = [line for line in log if line.strip()]
        if not added:
            continue  # not committed yet: --stamp again after the commit that adds it
        commit, date = added[-1].split()
        spec["commit"] = commit
        spec.setdefault("date", date)
        filled.append(name)
    return filled


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m eval.results_index",
                        description="Write results/INDEX.md from results/index.toml, the results folders and the "
                                    "pages that cite them; --check reports what disagrees.")
    ap.add_argument("--results", default="results", help="results folder (default: results)")
    ap.add_argument("--root", default=None, help="repository root holding README.md and docs/ (default: the "
                                                 "results folder's parent)")
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--check", action="store_true", help="change nothing; exit 1 with one line per problem")
    group.add_argument("--stamp", action="store_true", help="fill missing commits and dates in index.toml from git")
    args = ap.parse_args(argv)
    results = Path(args.results).resolve()
    root = Path(args.root).resolve() if args.root else results.parent
    index_path = results / "index.toml"
    index = load_index(index_path)
    if args.check:
        found = problems(results, root, index, index_path)
        for line in found:
            print(line, file=sys.stderr)
        if found:
            return 1
        print(f"{results.name}/INDEX.md is up to date ({len(index)} entries, every one cited)")
        return 0
    if args.stamp:
        filled = stamp(results, root, index)
        atomic_write_text(index_path, render_index_toml(index))
        print(f"stamped {len(filled)} entr{'y' if len(filled) == 1 else 'ies'} in {index_path}"
              + (f": {', '.join(filled)}" if filled else ""))
    text = render(build_rows(results, root, index))
    atomic_write_text(results / "INDEX.md", text)
    print(f"wrote {results / 'INDEX.md'} ({len(index)} entries in index.toml)")
    return 0


if __name__ == "__main__":
    run_cli(main)
