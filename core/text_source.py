"""Streaming training/calibration text: documents -> tokens -> packed BOS-led windows, exactly resumable.

`TextSourceConfig.source` names one of:
  wikitext2-valid+code-train   project training corpora (core.data), '+'-joined; evaluation corpora refused
  path/to/file-or-folder       local .txt, .jsonl/.json or .parquet files (one kind per source); the files
                               of the evaluation corpora (or byte-identical copies) are refused
  hf:<name>[:<config>]         a hub dataset, streamed (clusters; never loaded by the tests); a hub that
                               cannot be reached is one line saying so, not the client's traceback. One
                               fetched ahead (`smelt prefetch`, core.hub_datasets) streams from the local
                               cache; under SMELT_OFFLINE=1 one that is not is a one-line error

Each source becomes a `datasets` IterableDataset read with streaming=True, split between data-parallel
ranks with `split_dataset_by_node`, and tokenized on the fly. `PackedTextStream.next_batch(b)` returns
[b, seq_len + 1] int64 rows: BOS, then the next seq_len tokens of the rank's token stream (inputs =
x[:-1], labels = x[1:]), like core.data.TokenStream and the evaluation windows, so a window may start
mid-document. In that stream, documents of files and hub datasets are separated by EOS; a project corpus
is one continuous text, cut into line-aligned pieces only so that it streams, shards and shuffles, so no
EOS is put between its pieces (TokenStream never had one).

Mixing: several project corpora are interleaved (datasets.interleave_datasets, seeded), each piece drawn
with probability proportional to its corpus' number of pieces, until all are used up: every epoch holds
all of each corpus' text, spread evenly, i.e. TokenStream's mix by token count.

Shuffling (shuffle_buffer > 0; 0 keeps the source order every epoch): each epoch reorders the shards
(set_epoch with a number from seed and epoch), and a buffer of shuffle_buffer tokenized documents hands
out a random one as each new one comes in. The buffer is ours, not datasets' `shuffle`, whose buffer
content is lost on resume.

`state_dict()` is plain Python (ints, strs, lists, dicts, None): the datasets position, the epoch, the
shuffle buffer and the rest of the current document as token lists, and the buffer's RNG state. No
tensors, because DCP loads tensors in place, which needs the saved shape, and the buffers vary in length.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, NoReturn

import numpy as np
import torch

from core import hub_datasets
from core.artifact import read_manifest
from core.data import (
    BUCKETS,
    CODE_DIR,
    CODE_FILES,
    CODE_SUFFIX,
    CORPUS_FILES,
    REPO,
    bos_id,
    is_corpus_mix,
    read_corpus,
    split_corpora,
)
from core.errors import SmeltError, one_line
from core.fetch import offline, offline_message

if TYPE_CHECKING:  # datasets (with pyarrow: 0.1 GiB of RSS) loads only where a stream is built, not for
    import datasets  # every stage that imports this module for its settings

SELF_TEXT_FILE = "text.jsonl"  # distill.self_text's rows in its output directory: a source of this kind
BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
SAMPLE_BY = ("document", "paragraph", "line")  # what one .txt document is (datasets' text builder)
PIECE_CHARS = 4000  # project corpora stream as line-aligned pieces of about this many characters
CORPUS_SHARDS = 16  # ... in this many shards, so ranks split them and epochs reorder them
STATE_VERSION = 1
_log = logging.getLogger(__name__)


def _eval_files() -> list[Path]:
    """The files behind the evaluation buckets, in $SMELT_DATA and in the repository's data/."""
    roots = {REPO / "data", Path(os.environ.get("SMELT_DATA", REPO / "data"))}
    rels = [CORPUS_FILES[c] for c in BUCKETS.values() if c in CORPUS_FILES]
    rels += [f"{CODE_DIR}/{f}{CODE_SUFFIX}" for f in CODE_FILES]  # the `code` bucket
    return [(root / rel).resolve() for root in roots for rel in rels if (root / rel).is_file()]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclass(kw_only=True)
class TextSourceConfig:
    """Where training/calibration text comes from; checked once, here (see the module docstring)."""
    source: str = "wikitext2-valid"
    text_field: str = "text"  # the column holding the text (.jsonl/.json, .parquet, hub)
    split: str = "train"
    seed: int = 0
    shuffle_buffer: int = 64  # documents (they travel in every checkpoint, tokenized); 0 = no shuffle
    sample_by: str = "document"  # one .txt document is a whole file, a blank-line paragraph or a line
    flag: ClassVar[str] = "--dataloader"  # error messages name fields as <flag>.<field>

    def __post_init__(self):
        for name in ("source", "text_field", "split", "sample_by"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                self.fail(name, f"must be a non-empty string, got {getattr(self, name)!r}")
        for name in ("seed", "shuffle_buffer"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                self.fail(name, f"must be an integer >= 0, got {value!r}")
        if self.sample_by not in SAMPLE_BY:
            self.fail("sample_by", f"{self.sample_by!r} is not one of {', '.join(SAMPLE_BY)}")
        self.resolve()

    def fail(self, name: str, message: str) -> NoReturn:
        raise SmeltError(f"{self.flag}.{name}: {message}")

    def resolve(self) -> tuple[str, object]:
        """(kind, what): ("corpus", names) | ("hf", (name, config)) | (builder, files) for local files."""
        src = self.source
        if src.startswith("hf:"):
            name, _, config = src[3:].partition(":")
            if not name:
                self.fail("source", f"{src!r}: expected hf:<dataset name>[:<config>]")
            if "wikitext" in name.rsplit("/", 1)[-1].lower() and self.split.startswith("test"):
                self.fail("split", f"{src} split {self.split!r} is the evaluation text (WikiText-2 test); "
                                   f"evaluation text must never be trained on")
            return "hf", (name, config or None)
        if not is_corpus_mix(src) and ("/" in src or os.sep in src or Path(src).suffix in BUILDERS or Path(src).exists()):
            return self._local(Path(src).expanduser())
        try:
            return "corpus", split_corpora(src)
        except SmeltError as e:
            self.fail("source", str(e))

    def _local(self, path: Path) -> tuple[str, list[Path]]:
        if not path.exists():
            self.fail("source", f"path {path} does not exist")
        if path.is_dir() and _is_self_text_dir(path):  # its text, not its manifest.json beside it
            path = path / SELF_TEXT_FILE
        if path.is_file():
            if path.suffix not in BUILDERS:
                self.fail("source", f"{path}: unsupported file type (use {', '.join(BUILDERS)})")
            files = [path]
        else:  # every supported file below the folder, hidden ones aside, in a fixed order
            files = sorted(p for p in path.rglob("*") if p.suffix in BUILDERS and p.is_file()
                           and not any(part.startswith(".") for part in p.relative_to(path).parts))
            if not files:
                self.fail("source", f"folder {path} holds no {', '.join(BUILDERS)} files")
        kinds = {BUILDERS[f.suffix] for f in files}
        if len(kinds) > 1:
            self.fail("source", f"{path} mixes file types ({', '.join(sorted(kinds))}); use one kind per source")
        evals = _eval_files()
        sized = {}  # copies too: compare contents with the evaluation files of the same size
        for e in evals:
            sized.setdefault(e.stat().st_size, []).append(e)
        for f in files:
            same = [e for e in sized.get(f.stat().st_size, []) if f.resolve() == e or _sha(f) == _sha(e)]
            if same:
                self.fail("source", f"{f} is evaluation text ({same[0]}); evaluation text must never be "
                                    f"trained or calibrated on")
        (kind,) = kinds
        if kind == "text" and self.text_field != "text":
            self.fail("text_field", f"{self.text_field!r}: .txt files have one field, 'text'")
        return kind, files


def _is_self_text_dir(path: Path) -> bool:
    """Whether a folder is distill.self_text's output (its manifest says so)."""
    if not (path / "manifest.json").is_file() or not (path / SELF_TEXT_FILE).is_file():
        return False
    try:
        return read_manifest(path)["stage"] == "self_text"
    except SmeltError:  # not a smelt manifest: an ordinary folder of files
        return False


def _pieces(text: str) -> list[str]:
    """Line-aligned pieces of about PIECE_CHARS characters; joined in order they give the text back."""
    out, cur, n = [], [], 0
    for line in text.splitlines(keepends=True):
        cur.append(line)
        n += len(line)
        if n >= PIECE_CHARS:
            out.append("".join(cur))
            cur, n = [], 0
    return out + ["".join(cur)] if cur else out


def network_errors() -> tuple[type[BaseException], ...]:
    """What the hub clients raise when the network fails: OSError covers ConnectionError (datasets' own,
    huggingface_hub's offline and HTTP errors, requests, aiohttp); httpx's transport errors are not OSErrors."""
    try:
        import httpx
    except ImportError:  # pragma: no cover - huggingface_hub >= 1 depends on it
        return (OSError,)
    return (OSError, httpx.TransportError)


@contextlib.contextmanager
def hub_access(config: TextSourceConfig) -> Iterator[None]:
    """Around every read of an `hf:` source: a hub that cannot be reached, or a dataset it does not have, is
    one SmeltError line naming the source (the clients' own errors come after retries, as long tracebacks)."""
    from datasets.exceptions import DatasetNotFoundError

    try:
        yield
    except DatasetNotFoundError as e:
        config.fail("source", f"{config.source}: not found on the Hugging Face Hub, or gated ({one_line(e)})")
    except network_errors() as e:
        name = config.source[3:].partition(":")[0]
        config.fail("source", f"{config.source} could not be reached ({type(e).__name__}: {one_line(e)}); compute "
                              f"nodes often have no internet: download it on a machine with internet (hf download {name} "
                              f"--repo-type dataset --local-dir DIR) and give DIR as the source")


def build_dataset(config: TextSourceConfig) -> tuple[str, datasets.IterableDataset]:
    """The source as one streaming dataset (not yet split between ranks) and its kind."""
    import datasets

    kind, what = config.resolve()
    if kind == "hf":
        name, cfg = what
        local = hub_datasets.local_files(name, cfg, config.split)
        if local is not None:  # fetched ahead (smelt prefetch): its files in the hub cache, no network
            builder, files = local
            return kind, datasets.load_dataset(builder, data_files={config.split: files}, split=config.split,
                                               streaming=True)
        if offline():
            config.fail("source", offline_message(f"dataset {hub_datasets.label(name, cfg, config.split)}",
                                                  hub_datasets.record_path(name, cfg, config.split)))
        with hub_access(config):
            return kind, datasets.load_dataset(name, cfg, split=config.split, streaming=True)
    if kind != "corpus":
        extra = {"sample_by": config.sample_by} if kind == "text" else {}  # a line document: no "\n"
        files = {config.split: [str(f) for f in what]}
        return kind, datasets.load_dataset(kind, data_files=files, split=config.split, streaming=True, **extra)
    parts = [_pieces(read_corpus(n)) for n in what]
    sets = [datasets.Dataset.from_dict({"text": p}).to_iterable_dataset(num_shards=min(CORPUS_SHARDS, len(p)))
            for p in parts]
    if len(sets) == 1:
        return kind, sets[0]
    total = sum(len(p) for p in parts)
    return kind, datasets.interleave_datasets(sets, probabilities=[len(p) / total for p in parts],
                                              seed=config.seed, stopping_strategy="all_exhausted_without_replacement")


class PackedTextStream:
    """This rank's [batch, seq_len + 1] windows (BOS + seq_len tokens) of a text source, over endless epochs."""

    def __init__(self, config: TextSourceConfig, tokenizer, seq_len: int, dp_rank: int = 0,
                 dp_world_size: int = 1):
        if seq_len < 1 or not 0 <= dp_rank < dp_world_size:
            raise SmeltError(f"text stream needs seq_len >= 1 and 0 <= dp_rank < dp_world_size (got seq_len="
                             f"{seq_len}, dp_rank={dp_rank}, dp_world_size={dp_world_size})")
        self.config, self.tokenizer, self.seq_len = config, tokenizer, seq_len
        self.rank, self.world = dp_rank, dp_world_size
        self.bos = bos_id(tokenizer)
        kind, self._base = build_dataset(config)
        self._kind = kind
        if kind == "hf" and self._base.num_shards % dp_world_size:
            # split_dataset_by_node then has every rank read every shard and keep 1/world of the examples.
            _log.warning("%s has %d shards, not a multiple of %d data-parallel ranks: every rank downloads and "
                         "parses all of it; prefer a local copy (parquet folder) with a multiple of the ranks",
                         config.source, self._base.num_shards, dp_world_size)
        self._field = "text" if kind == "corpus" else config.text_field
        if kind == "corpus":
            self._sep = []
        elif tokenizer.eos_token_id is None:
            raise SmeltError("tokenizer has no EOS token; documents are separated by one")
        else:
            self._sep = [int(tokenizer.eos_token_id)]
        columns = self._base.column_names  # known up front for most sources; else checked on each read
        if columns is not None and self._field not in columns:
            config.fail("text_field", f"{self._field!r} is not a column of {config.source} "
                                      f"(columns: {', '.join(columns)})")
        self._rng = np.random.default_rng([config.seed, dp_rank])
        self.epoch, self._epoch_docs = 0, 0
        self._buffer: list[list[int]] = []  # shuffle buffer: tokenized documents (+ separator)
        self._carry, self._off = [], 0  # the current document and how much of it is already out
        self._start_epoch(None)

    def _start_epoch(self, ds_state: dict | None) -> None:
        # A fresh split each epoch, so a resumed position applies to the epoch it was saved in only.
        from datasets.distributed import split_dataset_by_node

        ds = split_dataset_by_node(self._base, rank=self.rank, world_size=self.world)
        if self.config.shuffle_buffer:
            ds.set_epoch(1 + self.config.seed * 100003 + self.epoch)  # shard order per (seed, epoch)
        if ds_state is not None:
            ds.load_state_dict(ds_state)
        with self._reading():
            self._ds, self._it, self._ds_state, self._read = ds, iter(ds), ds_state, False

    def _reading(self):
        """hub_access for an `hf:` source (its shards are read over the network as the stream goes)."""
        return hub_access(self.config) if self._kind == "hf" else contextlib.nullcontext()

    def _tokens(self, example: dict) -> list[int]:
        if self._field not in example:
            self.config.fail("text_field", f"{self._field!r} is not a field of {self.config.source} "
                                           f"(fields: {', '.join(example)})")
        text = example[self._field]
        if text is None:
            return []
        if not isinstance(text, str):
            self.config.fail("text_field", f"{self._field!r} of {self.config.source} holds "
                                           f"{type(text).__name__}, not text")
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _next_document(self) -> list[int]:
        size = self.config.shuffle_buffer
        while True:
            try:
                with self._reading():
                    example = next(self._it)
            except StopIteration:
                if self._epoch_docs == 0:  # an empty epoch would loop for ever
                    self.config.fail("source", f"{self.config.source} has no text for data-parallel rank "
                                               f"{self.rank} of {self.world}")
                self.epoch, self._epoch_docs = self.epoch + 1, 0
                self._start_epoch(None)
                continue
            self._read = True
            ids = self._tokens(example)
            if not ids:
                continue
            self._epoch_docs += 1
            doc = ids + self._sep
            if not size:
                return doc
            if len(self._buffer) < size:
                self._buffer.append(doc)
                continue
            i = int(self._rng.integers(size))
            doc, self._buffer[i] = self._buffer[i], doc
            return doc

    def _window(self) -> list[int]:
        out, need = [self.bos], self.seq_len
        while need:
            if self._off >= len(self._carry):
                self._carry, self._off = self._next_document(), 0
            take = self._carry[self._off:self._off + need]
            out += take
            self._off += len(take)
            need -= len(take)
        return out

    def next_batch(self, batch_size: int) -> torch.Tensor:
        """[batch_size, seq_len + 1] int64: BOS, then the next seq_len tokens of this rank's stream, per row."""
        return torch.tensor([self._window() for _ in range(batch_size)], dtype=torch.long)

    def state_dict(self) -> dict:
        c = self.config
        return {"version": STATE_VERSION, "source": c.source, "seed": c.seed, "shuffle_buffer": c.shuffle_buffer,
                "dp_rank": self.rank, "dp_world_size": self.world, "epoch": self.epoch,
                "epoch_docs": self._epoch_docs, "dataset": self._ds.state_dict() if self._read else self._ds_state,
                "rng": self._rng.bit_generator.state, "buffer": [list(d) for d in self._buffer],
                "carry": self._carry[self._off:]}

    def load_state_dict(self, state: dict) -> None:
        c = self.config
        mine = {"version": STATE_VERSION, "source": c.source, "seed": c.seed, "shuffle_buffer": c.shuffle_buffer,
                "dp_rank": self.rank, "dp_world_size": self.world}
        for key, value in mine.items():
            if state.get(key) != value:
                raise SmeltError(f"text stream state was saved with {key}={state.get(key)!r}, this run has "
                                 f"{value!r}; resume needs the same source and data-parallel layout")
        self.epoch, self._epoch_docs = int(state["epoch"]), int(state["epoch_docs"])
        self._rng.bit_generator.state = state["rng"]
        self._buffer = [list(d) for d in state["buffer"]]
        self._carry, self._off = list(state["carry"]), 0
        self._start_epoch(state["dataset"])


def source_record(config: TextSourceConfig) -> dict:
    """What a manifest records about a non-corpus source: its files and their sha256, or the hub dataset."""
    kind, what = config.resolve()
    if kind == "hf":
        return {"source": config.source, "hf": what[0], "config": what[1], "split": config.split}
    if kind == "corpus":
        return {"source": config.source, "corpora": list(what)}
    return {"source": config.source, "files": [{"path": str(f), "sha256": _sha(f)} for f in what]}


class CalibrationSourceConfig(TextSourceConfig):
    flag: ClassVar[str] = "calibration"  # errors name the calibration source, not the training loader


def calibration_source_windows(source: str, tokenizer, n: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """[n, seq_len] BOS-led calibration windows from any text source (core.data.calibration_windows' path
    for local files and hub datasets): the stream's first n windows after a seeded document shuffle."""
    if n <= 0 or seq_len < 2:
        raise SmeltError(f"calibration needs n >= 1 and seq_len >= 2 (got n={n}, seq_len={seq_len})")
    config = CalibrationSourceConfig(source=source, seed=seed, shuffle_buffer=64)
    return PackedTextStream(config, tokenizer, seq_len - 1).next_batch(n)
