"""An artifact read for its release one tensor at a time: its weights (ArtifactTensors), the same weights as the
release ships them (ShippedWeights, the MTP probe's source) and its masks (ArtifactMasks), so that a model
larger than memory is released in the memory of its largest module."""
from __future__ import annotations

from pathlib import Path

import torch

from core.errors import SmeltError
from core.hf_names import to_hf_name
from core.masks import DENSE_ROWS, MASKS_FILE
from core.patterns import NMPattern
from core.safetensors_stream import SafetensorsReader
from models.hf_io import safetensors_files

SPARSE_24 = NMPattern(2, 4)  # the one N:M pattern a release declares (what sparse tensor cores run)


class ArtifactTensors:
    """An artifact's weights by HF name, read one tensor (or block of rows) at a time from its safetensors
    files: a release of a model larger than memory holds one module at a time."""

    def __init__(self, art: Path):
        self._by_name = {k: r for f in safetensors_files(art) for r in [SafetensorsReader(f)]
                         for k in r.keys()}  # noqa: SIM118 - a reader, not a dict
        self.names = sorted(self._by_name)

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def shape(self, name: str) -> tuple[int, ...]:
        return self._by_name[name].shape(name)

    def dtype(self, name: str) -> torch.dtype:
        return self._by_name[name].dtype(name)

    def get(self, name: str) -> torch.Tensor:
        return self._by_name[name].get(name)

    def take(self, name: str, ids: list[int]) -> torch.Tensor:
        return self._by_name[name].take(name, ids)

    def row_blocks(self, name: str):
        return self._by_name[name].row_blocks(name)


class ShippedWeights:
    """The artifact's weights as the release ships them, by our names, in fp32 (models.source_model's source):
    quantized Linears exact (on their grid), everything else rounded to the serving dtype."""

    def __init__(self, src: ArtifactTensors, dtype: torch.dtype, quantized: set[str]):
        self.src, self.dtype, self.quantized = src, dtype, quantized

    def _shipped(self, name: str, t: torch.Tensor) -> torch.Tensor:
        t = t.float()
        return t if name.removesuffix(".weight") in self.quantized else t.to(self.dtype).float()

    def get(self, name: str) -> torch.Tensor:
        return self._shipped(name, self.src.get(to_hf_name(name)))

    def rows(self, name: str, ids: list[int]) -> torch.Tensor:
        return self._shipped(name, self.src.take(to_hf_name(name), ids))

    def row_blocks(self, name: str):
        for rows in self.src.row_blocks(to_hf_name(name)):
            yield self._shipped(name, rows)


class ArtifactMasks:
    """masks.safetensors read a module at a time: `names` (keep-masks), `mask(name)`, and `check_zeros`."""

    def __init__(self, art: Path):
        path = art / MASKS_FILE
        self._reader = SafetensorsReader(path) if path.is_file() else None
        keys = self._reader.keys() if self._reader else []
        self.names = sorted(k for k in keys if not k.endswith(f".{DENSE_ROWS}"))
        self.dense_rows = {k.removesuffix(f".{DENSE_ROWS}"): self._reader.get(k).bool()
                           for k in keys if k.endswith(f".{DENSE_ROWS}")}

    def mask(self, name: str) -> torch.Tensor:
        return self._reader.get(name).bool()

    def check_zeros(self, name: str, w: torch.Tensor) -> None:
        if name not in self.names:
            return
        mask = self.mask(name)
        bad = int((w[~mask] != 0).sum())
        if bad:
            kind = "2:4 mask" if SPARSE_24.holds(mask, self.dense_rows.get(name)) else "mask"
            raise SmeltError(f"{name}: {bad} weights are non-zero where the {kind} removes them")
