"""Streaming text source: local files and project corpora through `datasets`, packed BOS-led windows,
disjoint data-parallel ranks, exact resume, endless epochs, evaluation text refused."""
from __future__ import annotations

import io
import json
import re
import shutil
import time

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import core.text_source as ts
from core.data import REPO, read_corpus
from core.errors import SmeltError
from core.text_source import PackedTextStream, TextSourceConfig

DOCS = [f"doc {i:02d}: " + "word " * (i % 7) + "end" for i in range(40)]


def write_jsonl(path, docs, field="text"):
    path.write_text("".join(json.dumps({field: d, "n": i}) + "\n" for i, d in enumerate(docs)))
    return path


def stream(tok, source, seq_len=16, rank=0, world=1, **kw):
    return PackedTextStream(TextSourceConfig(source=str(source), **kw), tok, seq_len, rank, world)


def read_text(tok, s, batches, batch_size=4):
    """A rank's token stream as text: its windows without their BOS, joined."""
    rows = torch.cat([s.next_batch(batch_size) for _ in range(batches)])
    assert (rows[:, 0] == tok.bos_token_id).all() and (rows[:, 1:] != tok.bos_token_id).all()
    return tok.decode(rows[:, 1:].flatten().tolist())


def docs_of(text):
    return text.split("<eos>")[:-1]  # the last piece may be cut by the window


@pytest.mark.parametrize("kind", ["txt", "jsonl", "parquet"])
def test_local_files_give_bos_led_windows_of_their_documents(tmp_path, byte_tokenizer, kind):
    path = tmp_path / f"docs.{kind}"
    if kind == "txt":
        path.write_text("\n\n".join(DOCS) + "\n")
    elif kind == "jsonl":
        write_jsonl(path, DOCS)
    else:
        pq.write_table(pa.table({"text": DOCS, "n": list(range(40))}), path)
    batch = stream(byte_tokenizer, path, shuffle_buffer=0, sample_by="paragraph").next_batch(3)
    assert batch.shape == (3, 17) and batch.dtype == torch.long
    got = docs_of(read_text(byte_tokenizer, stream(byte_tokenizer, path, shuffle_buffer=0, sample_by="paragraph"), 10))
    assert len(got) > 10 and got == DOCS[:len(got)]  # in order, EOS between


def test_shuffled_txt_folder_keeps_whole_lines(tmp_path, byte_tokenizer):
    (tmp_path / "a").mkdir()
    for i in range(4):
        (tmp_path / "a" / f"f{i}.txt").write_text("\n".join(DOCS[i * 10:(i + 1) * 10]) + "\n")
    (tmp_path / "a" / ".hidden.txt").write_text("secret\n")
    s = stream(byte_tokenizer, tmp_path / "a", sample_by="line", shuffle_buffer=8, seed=3)
    got = docs_of(read_text(byte_tokenizer, s, 40))
    assert set(got) <= set(DOCS) and got[1:60] != DOCS[1:60] and len(set(got)) >= 39


def test_data_parallel_ranks_see_disjoint_documents(tmp_path, byte_tokenizer):
    one = write_jsonl(tmp_path / "one.jsonl", DOCS)
    (tmp_path / "two").mkdir()
    write_jsonl(tmp_path / "two" / "a.jsonl", DOCS[:20])
    write_jsonl(tmp_path / "two" / "b.jsonl", DOCS[20:])
    for source in (one, tmp_path / "two"):  # 1 shard: every other document; 2 shards: one file each
        seen = []
        for rank in (0, 1):
            s = stream(byte_tokenizer, source, rank=rank, world=2, shuffle_buffer=4)
            text = read_text(byte_tokenizer, s, 12)
            assert s.epoch >= 1
            seen.append({d for d in docs_of(text) if d in DOCS})
        assert not seen[0] & seen[1] and seen[0] | seen[1] == set(DOCS)


def fake_corpora(monkeypatch, a=300, b=100):
    """Two small project corpora, one numbered line a piece: A000..., B000..."""
    fake = {"wikitext2-valid": [f"A{i:03d}" for i in range(a)], "code-train": [f"B{i:03d}" for i in range(b)]}
    monkeypatch.setattr(ts, "read_corpus", lambda name: "".join(x + "\n" for x in fake[name]))
    monkeypatch.setattr(ts, "PIECE_CHARS", 5)
    return fake


@pytest.mark.parametrize("kind", ["files", "corpora"])
def test_resume_is_bit_exact_and_the_state_is_plain(tmp_path, monkeypatch, byte_tokenizer, kind):
    source = tmp_path / "d"  # 3 files, 2 ranks: every other document; both: several epochs in 30 batches
    source.mkdir()
    for i in range(3):
        write_jsonl(source / f"{i}.jsonl", DOCS[i::3])
    if kind == "corpora":
        fake_corpora(monkeypatch, 60, 20)
        source = "wikitext2-valid+code-train"

    def make():
        return stream(byte_tokenizer, source, seq_len=24, rank=1, world=2, shuffle_buffer=5)

    ref = make()
    expected = [ref.next_batch(3) for _ in range(30)]  # several epochs
    for k in (0, 1, 7, 19):
        a = make()
        for _ in range(k):
            a.next_batch(3)
        buf = io.BytesIO()
        torch.save(a.state_dict(), buf)  # what DCP needs: nothing but plain Python
        state = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
        b = make()
        b.load_state_dict(state)
        for i in range(k, 30):
            assert torch.equal(b.next_batch(3), expected[i]), (k, i)
    assert ref.epoch >= 2
    with pytest.raises(SmeltError, match="dp_rank=1"):
        stream(byte_tokenizer, source, seq_len=24, rank=0, world=2, shuffle_buffer=5).load_state_dict(state)


def test_epochs_loop_over_the_same_text(tmp_path, byte_tokenizer):
    s = stream(byte_tokenizer, write_jsonl(tmp_path / "d.jsonl", DOCS[:3]), shuffle_buffer=0)
    text = read_text(byte_tokenizer, s, 20)
    cycle = "".join(d + "<eos>" for d in DOCS[:3])
    assert s.epoch > 10 and text == (cycle * 30)[:len(text)]


def test_project_corpus_streams_its_own_lines(byte_tokenizer):
    lines = set(read_corpus("code-train").splitlines())
    for rank in (0, 1):
        s = stream(byte_tokenizer, "code-train", seq_len=256, rank=rank, world=2, shuffle_buffer=16)
        rows = s.next_batch(4)
        assert rows.shape == (4, 257) and (rows[:, 0] == byte_tokenizer.bos_token_id).all()
        assert (rows[:, 1:] != byte_tokenizer.eos_token_id).all()  # one continuous text: no EOS
        for row in rows:
            inner = byte_tokenizer.decode(row[1:].tolist()).split("\n")[1:-1]
            assert inner and set(inner) <= lines


def test_mixed_corpora_interleave_evenly_and_split_between_ranks(monkeypatch, byte_tokenizer):
    fake = fake_corpora(monkeypatch)
    seen = []
    for rank in (0, 1):
        s = stream(byte_tokenizer, "wikitext2-valid+code-train", seq_len=50, rank=rank, world=2, shuffle_buffer=0)
        got = re.findall(r"[AB]\d{3}", read_text(byte_tokenizer, s, 1, batch_size=20))  # 1000 chars, 1 epoch
        assert len(got) == len(set(got)) == 200 and s.epoch == 0
        first_half = got[:100]
        assert 15 <= sum(g[0] == "B" for g in first_half) <= 35  # 1 in 4 are B all along, not B at the end
        seen.append(set(got))
    assert not seen[0] & seen[1] and seen[0] | seen[1] == set(fake["wikitext2-valid"] + fake["code-train"])


def test_evaluation_text_is_refused(tmp_path):
    for name in ("wikitext2-test", "wikitext2-valid+zh", "code"):
        with pytest.raises(SmeltError, match=r"^--dataloader\.source: .*never be trained"):
            TextSourceConfig(source=name)
    copy = tmp_path / "mine" / "notes.txt"
    copy.parent.mkdir()
    shutil.copy(REPO / "data" / "zh" / "compression_notes.txt", copy)
    for path in (REPO / "data" / "wikitext2" / "test.txt", REPO / "data" / "code" / "python311",
                 REPO / "data", copy.parent):
        with pytest.raises(SmeltError, match=r"^--dataloader\.source: .* is evaluation text"):
            TextSourceConfig(source=str(path))
    with pytest.raises(SmeltError, match=r"^--dataloader\.split: .*never be trained"):
        TextSourceConfig(source="hf:Salesforce/wikitext:wikitext-2-raw-v1", split="test")
    TextSourceConfig(source=str(REPO / "data" / "wikitext2" / "valid.txt"))  # training text is fine


def test_bad_settings_are_one_line_errors_naming_the_field(tmp_path, byte_tokenizer):
    jsonl = write_jsonl(tmp_path / "d.jsonl", DOCS, field="body")
    (tmp_path / "d.txt").write_text("hello\n")
    cases = [({"source": str(tmp_path / "nope.jsonl")}, "source: path .* does not exist"),
             ({"source": "wikitext2-valid+nope"}, "source: .*'nope' is unknown"),
             ({"source": str(tmp_path / "d.txt"), "text_field": "body"}, "text_field: 'body': .txt"),
             ({"source": "code-train", "shuffle_buffer": -1}, "shuffle_buffer: must be an integer >= 0"),
             ({"source": "code-train", "sample_by": "page"}, "sample_by: 'page' is not one of")]
    for kw, message in cases:
        with pytest.raises(SmeltError, match=rf"^--dataloader\.{message}") as e:
            TextSourceConfig(**kw)
        assert "\n" not in str(e.value)
    with pytest.raises(SmeltError, match=r"^--dataloader\.text_field: 'text' is not a column .*body, n\)$"):
        stream(byte_tokenizer, jsonl)
    lone = stream(byte_tokenizer, write_jsonl(tmp_path / "one.jsonl", DOCS[:1]), rank=1, world=2)
    with pytest.raises(SmeltError, match=r"^--dataloader\.source: .* has no text for data-parallel rank 1 of 2$"):
        lone.next_batch(1)
    assert docs_of(read_text(byte_tokenizer, stream(byte_tokenizer, jsonl, text_field="body", shuffle_buffer=0),
                             2))[0] == DOCS[0]


def test_hub_source_builds_the_streaming_call_without_network(monkeypatch, byte_tokenizer):
    calls = []

    def fake_load_dataset(*args, **kwargs):
        calls.append((args, kwargs))
        return datasets.Dataset.from_dict({"content": DOCS}).to_iterable_dataset(num_shards=4)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    s = stream(byte_tokenizer, "hf:HuggingFaceFW/fineweb-edu:sample-10BT", text_field="content",
               split="train", shuffle_buffer=0)
    assert calls == [(("HuggingFaceFW/fineweb-edu", "sample-10BT"), {"split": "train", "streaming": True})]
    assert docs_of(read_text(byte_tokenizer, s, 2))[0] == DOCS[0]
    stream(byte_tokenizer, "hf:some/dataset", text_field="content", split="validation")
    assert calls[-1] == (("some/dataset", None), {"split": "validation", "streaming": True})


def test_an_unreachable_hub_source_is_one_line_naming_it(monkeypatch, byte_tokenizer):
    """There is no network here, so a hub source fails for real; offline mode makes the clients fail at once
    instead of after their retries (about 30 s)."""
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    start = time.perf_counter()
    with pytest.raises(SmeltError, match=r"^calibration\.source: hf:nobody/nothing:sub could not be reached "
                                         r"\(ConnectionError: Couldn't reach 'nobody/nothing' on the Hub .*\); compute "
                                         r"nodes often have no internet: .*\(hf download nobody/nothing --repo-type "
                                         r"dataset --local-dir DIR\) and give DIR as the source$") as e:
        ts.calibration_source_windows("hf:nobody/nothing:sub", byte_tokenizer, 2, 16)
    assert "\n" not in str(e.value) and time.perf_counter() - start < 10

    def lost():  # the connection drops while the stream reads a shard
        raise ConnectionError("Connection reset by peer")
        yield

    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: datasets.IterableDataset.from_generator(lost))
    s = stream(byte_tokenizer, "hf:some/dataset", shuffle_buffer=0)
    with pytest.raises(SmeltError, match=r"^--dataloader\.source: hf:some/dataset could not be reached "
                                         r"\(ConnectionError: Connection reset by peer\); compute nodes"):
        s.next_batch(1)


def test_calibration_takes_any_source_and_still_refuses_evaluation_text(tmp_path, byte_tokenizer):
    from core.data import calibration_windows

    src = write_jsonl(tmp_path / "calib.jsonl", DOCS)
    w = calibration_windows(byte_tokenizer, 5, 24, seed=1, corpus=str(src))
    assert w.shape == (5, 24) and (w[:, 0] == byte_tokenizer.bos_token_id).all()
    assert "doc " in byte_tokenizer.decode(w[:, 1:].flatten().tolist())
    assert torch.equal(w, calibration_windows(byte_tokenizer, 5, 24, seed=1, corpus=str(src)))  # seeded
    with pytest.raises(SmeltError, match=r"^calibration.source: .*evaluation text"):
        calibration_windows(byte_tokenizer, 2, 24, corpus=str(REPO / "data" / "wikitext2" / "test.txt"))
    with pytest.raises(SmeltError, match=r"^calibration.source: path .* does not exist"):
        calibration_windows(byte_tokenizer, 2, 24, corpus=str(tmp_path / "nope.jsonl"))
