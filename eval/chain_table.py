"""One chain's result table: each model a row, KL mean / P99 per bucket, PPL x teacher, top-1, needle, size.

A results section whose section.toml says `kind = "chain"` is rendered by this module (through
`python -m eval.tables`), so the README's headline table comes from committed JSON like every other table:

    kind = "chain"
    buckets = ["en", "zh", "code", "news"]     # KL columns, in order
    sizes = "sizes.json"                        # {"bytes": {key: n}, "command": ...}: measured bytes on disk
    [[times]]                                   # the runs that made the rows: /usr/bin/time -v reports
    file = "a-time-v.txt"
    what = "the stages up to the quantized fit"


    [[rows]]
    label = "teacher"
    file = "teacher.json"                       # an eval.evaluate report; the first row is the teacher
    size = "teacher-bf16"                       # optional: a key of sizes.json
"""
from __future__ import annotations

import re
from pathlib import Path

from core.errors import SmeltError
from core.files import read_json

CHAIN_KEYS = {"kind", "buckets", "sizes", "times", "rows"}
ROW_KEYS = {"label", "file", "size"}
NEEDLE_LENGTH = "2048"
MISSING = "–"
WALL_RE = re.compile(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([0-9:.]+)")
RSS_RE = re.compile(r"Maximum resident set size \(kbytes\): (\d+)")


def _str_list(value, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise SmeltError(f"{where} must be a list of names")
    return value


def load_chain(folder: Path, spec: dict, where: str) -> dict:
    """Check a chain section's spec and read everything it names; errors name the key."""
    unknown = set(spec) - CHAIN_KEYS
    if unknown:
        raise SmeltError(f"{where}: unknown key(s) {sorted(unknown)} (allowed: {sorted(CHAIN_KEYS)})")
    buckets = _str_list(spec.get("buckets"), f"{where}: 'buckets'")
    sizes = {}
    if "sizes" in spec:
        doc = read_json(folder / str(spec["sizes"]), "a sizes file")
        if not isinstance(doc, dict) or not isinstance(doc.get("bytes"), dict):
            raise SmeltError(f"{where}: 'sizes' file {spec['sizes']} needs a 'bytes' table")
        sizes = doc["bytes"]
    times = []
    for i, t in enumerate(spec.get("times", []), 1):
        if not isinstance(t, dict) or set(t) != {"file", "what"}:
            raise SmeltError(f"{where}: times {i} needs exactly 'file' and 'what'")
        path = folder / str(t["file"])
        if not path.is_file():
            raise SmeltError(f"{where}: 'times' names {path}, which does not exist")
        text = path.read_text(encoding="utf-8")
        wall, rss = WALL_RE.search(text), RSS_RE.search(text)
        if not wall:
            raise SmeltError(f"{where}: {path} is not a /usr/bin/time -v report (no wall clock line)")
        times.append({"wall": wall.group(1).split(".")[0], "what": t["what"],
                      "rss_gib": int(rss.group(1)) / 2**20 if rss else None})
    rows_spec = spec.get("rows")
    if not isinstance(rows_spec, list) or not rows_spec:
        raise SmeltError(f"{where}: needs a non-empty list of rows ([[rows]] with label and file)")
    rows = []
    for i, r in enumerate(rows_spec, 1):
        at = f"{where} row {i}"
        if not isinstance(r, dict) or set(r) - ROW_KEYS:
            raise SmeltError(f"{at}: keys are {sorted(ROW_KEYS)}")
        if not isinstance(r.get("label"), str) or not isinstance(r.get("file"), str):
            raise SmeltError(f"{at}: needs 'label' and 'file'")
        report = read_json(folder / r["file"], "an eval.evaluate report")
        if not isinstance(report, dict) or not isinstance(report.get("buckets"), dict):
            raise SmeltError(f"{at}: {r['file']} has no 'buckets' (not an eval.evaluate report?)")
        size = r.get("size")
        if size is not None and size not in sizes:
            raise SmeltError(f"{at}: 'size' {size!r} is not a key of the sizes file")
        rows.append({"label": r["label"], "file": r["file"], "report": report,
                     "bytes": sizes.get(size) if size else None})
    return {"buckets": buckets, "rows": rows, "times": times}


def needle_at(report: dict, length: str = NEEDLE_LENGTH) -> float | None:
    langs = (report.get("needle") or {}).get("languages") or {}
    value = (langs.get("en") or {}).get("by_length", {}).get(length)
    return float(value) if isinstance(value, (int, float)) else None


def render_chain(name: str, chain: dict) -> str:
    """The table, then one line per machine and evaluation setting, then the measured wall times."""
    rows, buckets = chain["rows"], chain["buckets"]
    first = rows[0]["report"]["buckets"]
    head = ["model"] + [f"{b} KL mean / P99" for b in buckets] + [
        f"{buckets[0]} PPL (× teacher)", f"{buckets[0]} top-1", "needle 2K", "size"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for r in rows:
        b = r["report"]["buckets"]
        cells = [r["label"].replace("|", "\\|")]
        for k in buckets:
            m = b.get(k, {})
            ok = isinstance(m.get("kl_mean"), (int, float)) and isinstance(m.get("kl_p99"), (int, float))
            cells.append(f"{m['kl_mean']:.3f} / {m['kl_p99']:.2f}" if ok else MISSING)
        ppl, ref = b.get(buckets[0], {}).get("ppl"), first.get(buckets[0], {}).get("ppl")
        cells.append(f"{ppl:.2f} ({ppl / ref:.2f}×)" if ppl and ref else MISSING)
        top1 = b.get(buckets[0], {}).get("top1_agree")
        cells.append(f"{top1:.3f}" if isinstance(top1, (int, float)) else MISSING)
        needle = needle_at(r["report"])
        cells.append(f"{needle:.0%}" if needle is not None else MISSING)
        cells.append(f"{r['bytes'] / 1e6:.0f} MB" if r["bytes"] else MISSING)
        lines.append("| " + " | ".join(cells) + " |")
    machines: dict[str, list[str]] = {}
    for r in rows:
        m = r["report"].get("machine") or {}
        cpu = f"{m.get('cpu', 'an unrecorded CPU')}, {m.get('cpu_count', '?')} cores" if m else "not recorded"
        machines.setdefault(cpu, []).append(r["label"])
    machine_text = "; ".join(f"{cpu} ({', '.join(labels)})" if len(machines) > 1 else cpu
                             for cpu, labels in machines.items())
    s = rows[0]["report"].get("settings") or {}
    windows = ", ".join(f"{k} {v}" for k, v in (s.get("windows") or {}).items())
    lines += ["", f"Measured on {machine_text}. Evaluation: {windows} windows × {s.get('seq_len', '?')} tokens; "
                  f"needle: share of the prompts answered at a {NEEDLE_LENGTH}-token context."]
    if chain["times"]:
        runs = "; ".join(f"{t['what']} {t['wall']}" + (f" (peak RSS {t['rss_gib']:.1f} GiB)"
                                                       if t["rss_gib"] else "") for t in chain["times"])
        lines.append(f"Wall time, `/usr/bin/time -v`: {runs}.")
    lines.append(f"Generated by `python -m eval.tables` from `results/{name}/`.")
    return "\n".join(lines)
