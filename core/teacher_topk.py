"""The teacher's top-k cache: training windows with the teacher's k most likely next tokens per position.

A distillation step that reads this cache needs no teacher forward. Per position it keeps the k largest
log-probabilities (ids and values) and the log of the mass left over (`rest`), so the teacher's
distribution is kept exactly on the partition {top-k tokens, everything else}: the loss on it
(distill.losses.topk_forward_kl) is a proper KL between the two coarsened distributions, a lower bound of
the full-vocabulary KL, equal to it when the student spreads the rest's mass over its tokens as the
teacher does.

Layout of a cache directory (`python -m distill.teacher_cache` writes it; docs/teacher-cache.md):
  teacher_topk.safetensors
    tokens    int32 [W, L + 1]   BOS-led windows; the trainer's input is [:, :-1], its labels [:, 1:]
    ids       int32 [W, L, k]    the teacher's top-k next-token ids at each input position, most likely first
    logprobs  fp16  [W, L, k]    their log-probabilities (temperature 1, full-vocabulary softmax in fp32)
    rest      fp32  [W, L]       log(1 - sum of the top-k probabilities), from the fp32 softmax
  manifest.json  stage "teacher_topk": teacher (path, weights fingerprint), source, seed, seq_len, top_k,
                 the rank layout the windows were drawn in, kept-mass statistics
Windows are stored in the order a run with `ranks` data-parallel ranks and `local_batch` windows per rank
would read them from the text stream (round r: rank 0's batch, rank 1's, ...), so a run with that layout
trains on exactly the windows the uncached run would.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from core.artifact import read_manifest
from core.errors import SmeltError

TOPK_FILE = "teacher_topk.safetensors"
STAGE = "teacher_topk"
KEYS = ("tokens", "ids", "logprobs", "rest")
SETTINGS = ("teacher", "teacher_fingerprint", "source", "seed", "text", "seq_len", "top_k", "vocab_size", "ranks",
            "local_batch")


@dataclass(frozen=True)
class TeacherTopK:
    """The teacher's top-k view of a batch: ids/logprobs [..., k], rest [...] (log of the remaining mass)."""
    ids: torch.Tensor
    logprobs: torch.Tensor
    rest: torch.Tensor

    @property
    def k(self) -> int:
        return self.ids.shape[-1]

    def flatten(self) -> TeacherTopK:
        """Positions as rows: [N, k] and [N]."""
        return TeacherTopK(self.ids.reshape(-1, self.k), self.logprobs.reshape(-1, self.k), self.rest.reshape(-1))

    def __getitem__(self, idx) -> TeacherTopK:
        """Indexed over the position dims, like teacher logits: t[s:e] (rows), t[:, k:] (MTP module k)."""
        return TeacherTopK(self.ids[idx], self.logprobs[idx], self.rest[idx])

    def coarse_logprobs(self) -> torch.Tensor:
        """[..., k + 1] fp32 log-probabilities of (top-k tokens, the rest), renormalised: the stored fp16 values
        and the fp32 rest need not sum to exactly 1."""
        both = torch.cat([self.logprobs.float(), self.rest.float().unsqueeze(-1)], dim=-1)
        return torch.log_softmax(both, dim=-1)


def topk_from_logits(logits: torch.Tensor, k: int) -> TeacherTopK:
    """The top-k view of full-vocabulary logits [..., V] (the cache's build and the tests use this)."""
    if not 1 <= k <= logits.shape[-1]:
        raise SmeltError(f"top_k={k} must be in [1, vocab size {logits.shape[-1]}]")
    logp = torch.log_softmax(logits.float(), dim=-1)
    vals, ids = logp.topk(k, dim=-1)
    rest = logp.scatter(-1, ids, float("-inf")).logsumexp(-1)  # exact, also when the top-k hold ~all mass
    return TeacherTopK(ids.to(torch.int32), vals.half(), rest)


class TopKCache:
    """A cache directory, opened for reading (memory-mapped): its manifest settings and windows by index."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not (self.path / TOPK_FILE).is_file():
            raise SmeltError(f"teacher_cache {self.path}: no {TOPK_FILE} (build one with "
                             f"`python -m distill.teacher_cache`)")
        manifest = read_manifest(self.path)
        if manifest["stage"] != STAGE:
            raise SmeltError(f"teacher_cache {self.path}: manifest stage {manifest['stage']!r} is not {STAGE!r}")
        self.settings = manifest["settings"]
        missing = [k for k in SETTINGS if k not in self.settings]
        if missing:
            raise SmeltError(f"teacher_cache {self.path}: manifest settings lack {missing[0]!r} (not a cache this "
                             f"version of distill.teacher_cache wrote)")
        try:  # kept open: windows are read (memory-mapped) batch by batch, never the whole cache at once
            self._file = safe_open(str(self.path / TOPK_FILE), framework="pt")
        except (SafetensorError, OSError) as e:
            raise SmeltError(f"teacher_cache {self.path / TOPK_FILE} is not readable ({str(e).strip()})") from None
        names = set(self._file.keys())  # a safe_open handle is no dict
        missing = [k for k in KEYS if k not in names]
        if missing:
            raise SmeltError(f"teacher_cache {self.path / TOPK_FILE}: tensor {missing[0]!r} is missing")
        self._slices = {k: self._file.get_slice(k) for k in KEYS}
        w, l1 = self._slices["tokens"].get_shape()
        self.n_windows, self.seq_len = w, l1 - 1
        self.top_k = self._slices["ids"].get_shape()[-1]
        want = {"ids": [w, self.seq_len, self.top_k], "logprobs": [w, self.seq_len, self.top_k],
                "rest": [w, self.seq_len]}
        if any(self._slices[k].get_shape() != v for k, v in want.items()) or self.top_k != self.settings["top_k"]:
            raise SmeltError(f"teacher_cache {self.path}: tensor shapes disagree with each other or the manifest")

    def windows(self, idx: list[int]) -> tuple[torch.Tensor, TeacherTopK]:
        """tokens [n, L + 1] int64 and the teacher's top-k at those windows' input positions (ids stay int32:
        the loss widens them where it gathers)."""
        rows = {k: torch.stack([self._slices[k][i:i + 1][0] for i in idx]) for k in KEYS}
        return rows["tokens"].long(), TeacherTopK(rows["ids"], rows["logprobs"], rows["rest"])
