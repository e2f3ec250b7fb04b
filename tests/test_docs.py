"""The README and docs pages: short, complete, linked, and free of the work's history."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
MAX_README_WORDS = 3000
README_SECTIONS = ("## Status", "## Quick start", "## What the default gives", "## Using the release",
                   "## Your own model", "## On a cluster", "## Commands", "## Techniques", "## License")
DOC_PAGES = ("getting-started", "recipes", "pruning", "recovery", "quantization", "mtp", "evaluation", "cluster",
             "performance", "kernels", "release-format", "cli", "defaults-history")
# The history of the work belongs to git, not to the files users read.
NARRATION = (re.compile(r"\bissues? #?\d+\b", re.I),
             re.compile(r"\b(first|second|third|\w+th|\w+-\w+th|\w+ieth)\s+stop\b", re.I),
             re.compile(r"\b(this|last|next|earlier|previous) session\b", re.I),
             re.compile(r"\bsince (the (morning|evening) of )?20\d\d-\d\d-\d\d\b", re.I))
LINK_RE = re.compile(r"\]\(([^)#\s]+)(#[^)]*)?\)")


def _prose(text: str) -> str:
    """Markdown without fenced code (commands may legitimately say anything)."""
    return re.sub(r"```.*?```", "", text, flags=re.S)


def test_readme_is_short_and_has_its_sections():
    text = README.read_text(encoding="utf-8")
    words = len(_prose(text).split())
    assert words <= MAX_README_WORDS, f"README.md has {words} words (at most {MAX_README_WORDS})"
    missing = [s for s in README_SECTIONS if s not in text]
    assert not missing, f"README.md lacks {missing}"


def test_every_topic_has_its_page():
    names = {p.stem for p in PAGES}
    assert not set(DOC_PAGES) - names, f"docs/ lacks {sorted(set(DOC_PAGES) - names)}"


@pytest.mark.parametrize("path", [README, ROOT / "DEVELOPERS.md", *PAGES, *sorted((ROOT / "configs" / "recipes").glob("*.toml"))],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_no_file_narrates_the_work(path):
    text = _prose(path.read_text(encoding="utf-8"))
    hits = [m.group(0) for rx in NARRATION for m in rx.finditer(text)]
    assert not hits, f"{path.relative_to(ROOT)} narrates the work: {hits[:5]}"


@pytest.mark.parametrize("path", [README, *PAGES], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    broken = []
    for m in LINK_RE.finditer(path.read_text(encoding="utf-8")):
        target = m.group(1)
        if "://" in target or target.startswith("mailto:"):
            continue
        if not (path.parent / target).exists():
            broken.append(target)
    assert not broken, f"{path.relative_to(ROOT)} links to missing files: {broken}"
