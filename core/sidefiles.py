"""Side files of an artifact: safetensors next to model.safetensors keyed by HF module name.

masks.safetensors (`<module>`: bool keep-mask) and qparams.safetensors (`<module>.weight_scale`,
`<module>.weight_zero_point`) are both written and read here: layers renumbered like model.safetensors,
written atomically, read with the truncation/NaN checks of core.files. Keys are split back into
(module, suffix): a last part starting with `weight_` is a suffix (compressed-tensors' names).
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from core.files import (
    atomic_save_safetensors,
    check_finite,
    open_safetensors,
    read_safetensors,
    safetensors_metadata,
)
from core.hf_names import from_hf_name, to_hf_name
from core.safetensors_stream import StreamedSafetensors


def _split(key: str) -> tuple[str, str]:
    head, _, last = key.rpartition(".")
    return (head, last) if head and last.startswith("weight_") else (key, "")


def _hf_key(module: str, suffix: str, layer_index: dict[str, int] | None = None) -> str:
    key = to_hf_name(module, layer_index)
    return f"{key}.{suffix}" if suffix else key


def save_side_file(path: str | Path, tensors: dict[tuple[str, str], torch.Tensor],
                   layer_index: dict[str, int] | None, metadata: dict[str, str]) -> None:
    """tensors: {(our module name, suffix or ""): tensor}; saved under HF names, layers renumbered."""
    out = {_hf_key(module, suffix, layer_index): t for (module, suffix), t in tensors.items()}
    atomic_save_safetensors(out, path, metadata=metadata)


class StreamedSideFile:
    """The file save_side_file writes, written a few modules at a time as they are final (streamed stages:
    never held whole; layers keep their numbers). layout: [((module, suffix), dtype, shape)] in file order."""

    def __init__(self, path: str | Path, layout: list, metadata: dict[str, str]):
        self._rank = {key: i for i, (key, _, _) in enumerate(layout)}
        self.file = StreamedSafetensors(path, [(_hf_key(*key), dt, shape) for key, dt, shape in layout], metadata)

    def write(self, tensors: dict[tuple[str, str], torch.Tensor]) -> None:
        """Some entries (a block's), in any order; they go to the file in its order."""
        for key in sorted(tensors, key=self._rank.__getitem__):
            self.file.write(_hf_key(*key), tensors[key])

    def close(self) -> None:
        self.file.close()

    def abort(self) -> None:
        self.file.abort()


@contextlib.contextmanager
def closed_at_end(*files):
    """Streamed files (close/abort) closed when the body completes, every one aborted on an error: no
    partial file is left."""
    try:
        yield
        for f in files:
            f.close()
    except BaseException:
        for f in files:
            f.abort()
        raise


def load_side_file(path: str | Path) -> tuple[dict[tuple[str, str], torch.Tensor], dict[str, str]]:
    """({(our module name, suffix): tensor}, metadata) of a side file."""
    tensors = {}
    for key, t in read_safetensors(path).items():
        module, suffix = _split(key)
        tensors[(from_hf_name(module), suffix)] = t
    return tensors, safetensors_metadata(path)


class SideFileOnDisk:
    """A side file read one tensor at a time, when asked for ({(module, suffix): tensor} like load_side_file,
    without holding the file: streamed stages)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open_safetensors(self.path) as f:
            names = f.keys()  # a safe_open handle, not a dict
        self._keys = {(from_hf_name(m), suffix): key for key in names for m, suffix in [_split(key)]}

    def keys(self):
        return self._keys.keys()

    def __contains__(self, item) -> bool:
        return item in self._keys

    def __getitem__(self, item) -> torch.Tensor:
        with open_safetensors(self.path) as f:
            t = f.get_tensor(self._keys[item])
        check_finite(self._keys[item], t, self.path)
        return t

    def shape(self, item) -> tuple[int, ...]:
        with open_safetensors(self.path) as f:
            return tuple(f.get_slice(self._keys[item]).get_shape())

    def part(self, item, slices: tuple[slice, ...]) -> torch.Tensor:
        """The part `slices` of one tensor, reading only its bytes (a rank's shard)."""
        with open_safetensors(self.path) as f:
            t = f.get_slice(self._keys[item])[slices]
        check_finite(self._keys[item], t, self.path)
        return t
