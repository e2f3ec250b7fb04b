"""A safetensors file written one tensor at a time, for models that never sit in memory whole.

safetensors puts every tensor's offsets in the header, before the data. The layout (names, dtypes and
shapes, in file order) is known before calibration starts, so the header is written first and each
tensor's bytes follow in that order as soon as the tensor is final; the writer keeps none of them.
The file is a temporary sibling until every tensor has arrived, then renamed into place: an
interrupted stream leaves no file that looks whole.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

from core.errors import SmeltError

_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
           torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int32: "I32", torch.int64: "I64"}


class StreamedSafetensors:
    """Write `layout` [(name, dtype, shape), ...] to `path`; `write(name, tensor)` in layout order; `close()`.

    A tensor may also arrive in row chunks (`write(name, rows, part=True)` until its rows are complete), so
    a large embedding can be copied from another file without holding it whole.
    """

    def __init__(self, path: str | Path, layout: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self.layout = [(n, dt, tuple(int(s) for s in shape)) for n, dt, shape in layout]
        if len({n for n, _, _ in self.layout}) != len(self.layout):
            raise SmeltError(f"{self.path.name}: a tensor name appears twice in the layout")
        header: dict = {"__metadata__": dict(sorted(metadata.items()))} if metadata else {}  # core.files order
        offset = 0
        self._sizes = []
        for name, dtype, shape in self.layout:
            if dtype not in _DTYPES:
                raise SmeltError(f"{self.path.name}: {name} has dtype {dtype}, which safetensors cannot hold")
            size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            self._sizes.append(size)
            offset += size
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as safetensors' own writer does
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = self.path.parent / f".{self.path.name}.stream-{os.getpid()}"
        self._f = open(self._tmp, "wb")  # noqa: SIM115 - closed by close() or abort()
        self._f.write(struct.pack("<Q", len(blob)) + blob)
        self._next, self._written = 0, 0  # index of the tensor being written, its bytes so far

    @property
    def pending(self) -> str | None:
        """The next tensor the layout expects (None when complete)."""
        return self.layout[self._next][0] if self._next < len(self.layout) else None

    def write(self, name: str, tensor: torch.Tensor, part: bool = False) -> None:
        if self._f is None:
            raise SmeltError(f"{self.path.name}: written to after it was closed")
        if name != self.pending:
            raise SmeltError(f"{self.path.name}: {name} written out of order (expected {self.pending})")
        _, dtype, shape = self.layout[self._next]
        if tensor.dtype != dtype or (not part and tuple(tensor.shape) != shape) or (
                part and tuple(tensor.shape[1:]) != shape[1:]):
            raise SmeltError(f"{self.path.name}: {name} is {tensor.dtype} {tuple(tensor.shape)}, the layout "
                             f"says {dtype} {shape}")
        data = tensor.detach().contiguous().cpu()
        # bf16 has no numpy dtype: the bytes go through a same-width integer view
        raw = (data.view(torch.int16) if dtype == torch.bfloat16 else data).numpy().tobytes()
        if self._written + len(raw) > self._sizes[self._next]:
            raise SmeltError(f"{self.path.name}: {name} got more rows than its shape {shape}")
        self._written += len(raw)
        self._f.write(raw)
        if self._written == self._sizes[self._next]:
            self._next, self._written = self._next + 1, 0

    def close(self) -> Path:
        """Check every tensor arrived, flush, and rename the file into place."""
        if self.pending is not None:
            missing = self.pending
            self.abort()
            raise SmeltError(f"{self.path.name}: closed before {missing} was written")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        self._f = None
        os.replace(self._tmp, self.path)
        return self.path

    def abort(self) -> None:
        """Drop the partial file (an error upstream)."""
        if self._f is not None:
            self._f.close()
            self._f = None
        self._tmp.unlink(missing_ok=True)


_FROM_CODE = {code: dtype for dtype, code in _DTYPES.items()}
ROW_BLOCK_BYTES = 64 << 20  # a large tensor read in blocks (an 8B model's embedding is 2 GB in fp32)


class SafetensorsReader:
    """One safetensors file read tensor by tensor (or in row ranges) with plain reads, no memory map: a
    mapped file's touched pages stay in the process's resident set until it is unmapped, so reading a model
    larger than memory through safe_open grows it to the file's size. Names, dtypes and shapes come from the
    header alone; a truncated or corrupt file is one line naming it."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise SmeltError(f"{self.path} does not exist")
        size = self.path.stat().st_size
        try:
            with open(self.path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                if n > size - 8:
                    raise ValueError(f"header length {n} past the end of the file")
                header = json.loads(f.read(n))
            self.metadata = header.pop("__metadata__", None) or {}
            self._data = 8 + n
            self._entries = {k: (_FROM_CODE[v["dtype"]], tuple(v["shape"]), tuple(v["data_offsets"]))
                             for k, v in header.items()}
        except (ValueError, KeyError, TypeError, struct.error) as e:
            raise SmeltError(f"{self.path} is not a readable safetensors file (corrupt header: {e})") from None
        end = max((o[1] for _, _, o in self._entries.values()), default=0)
        if self._data + end > size:
            raise SmeltError(f"{self.path} is not a readable safetensors file (truncated: {size} bytes, the header "
                             f"needs {self._data + end})")

    def keys(self) -> list[str]:
        """Tensor names in file order."""
        return sorted(self._entries, key=lambda k: self._entries[k][2][0])

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name)[1]

    def dtype(self, name: str) -> torch.dtype:
        return self._entry(name)[0]

    def _entry(self, name: str):
        if name not in self._entries:
            raise SmeltError(f"{self.path} has no tensor {name}")
        return self._entries[name]

    def get(self, name: str) -> torch.Tensor:
        """The whole tensor, checked finite."""
        shape = self.shape(name)
        return self.rows(name, 0, shape[0] if shape else 1)

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of a tensor (a 0-d tensor: the whole of it), checked finite."""
        dtype, shape, (begin, _) = self._entry(name)
        row = torch.Size(shape[1:]).numel() * torch.empty((), dtype=dtype).element_size()
        buf = torch.empty((stop - start) * row, dtype=torch.uint8)
        with open(self.path, "rb") as f:
            f.seek(self._data + begin + start * row)
            if f.readinto(memoryview(buf.numpy())) != buf.numel():
                raise SmeltError(f"{self.path}: {name} is truncated")
        out = buf.view(dtype).reshape((stop - start, *shape[1:]) if shape else ())
        if out.is_floating_point() and not bool(torch.isfinite(out).all()):
            raise SmeltError(f"{self.path}: tensor {name} has {int((~torch.isfinite(out)).sum())} non-finite "
                             "value(s) (NaN/inf); refusing to load it")
        return out

    def take(self, name: str, ids: list[int]) -> torch.Tensor:
        """Rows `ids` of a tensor, in that order (an embedding's rows for a few tokens)."""
        return torch.cat([self.rows(name, i, i + 1) for i in ids]) if ids else self.rows(name, 0, 0)

    def row_blocks(self, name: str, max_bytes: int = ROW_BLOCK_BYTES):
        """The tensor in blocks of rows of at most `max_bytes` (a 0-d or 1-d tensor: whole)."""
        dtype, shape, _ = self._entry(name)
        if len(shape) < 2:
            yield self.get(name)
            return
        row = torch.Size(shape[1:]).numel() * torch.empty((), dtype=dtype).element_size()
        step = max(1, max_bytes // max(row, 1))
        for a in range(0, shape[0], step):
            yield self.rows(name, a, min(a + step, shape[0]))
