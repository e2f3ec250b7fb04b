"""The release's file layout (docs/release-format.md), shared by its writer (qat.release), its verifier
(qat.verify) and the kernels' loader (kernels.release_model): file names, the keep-mask packing, dense-row
ranges, and a reader that gives every quantized Linear's codes, scales and 2:4 structure in either 2:4
storage:

- `mask` (default; what vLLM and transformers load): pack-quantized `weight_packed` of every row, and the
  2:4 keep-mask in `sparsity.safetensors`;
- `compressed` (`qat.release --sparse-storage compressed`): a 2:4 module stores only its kept codes and their
  position metadata (core.packing's `smelt-24/1`), so the bytes on disk are the bytes a 2:4 + W4 decode step
  reads; `python -m qat.release --expand` rewrites such a release into the `mask` storage.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from core.errors import SmeltError
from core.hf_names import to_hf_name
from core.packing import unpack_24, unpack_int4
from core.safetensors_stream import SafetensorsReader

RELEASE_MANIFEST = "smelt_release.json"
SPARSITY_FILE = "sparsity.safetensors"
SPARSITY_JSON = "sparsity.json"
STORAGES = ("mask", "compressed")
SPARSITY_LAYOUT = ("per module '<module>.keep_bits': uint8 [out, ceil(in/8)], the bool keep-mask packed "
                   "along the input dim, little-endian bit order (input i -> byte i//8, bit i%8), so each "
                   "nibble is one group of 4 inputs (bit j = position j kept); padding bits are 0")
COMPRESSED_LAYOUT = ("per module in model.safetensors: '<module>.weight_kept' int32 [sparse rows, in/16], the "
                     "kept int4 codes (2 per group of 4 inputs, +8 offset, 8 per word); '<module>.weight_meta' "
                     "int32 [sparse rows, in/32], 4 bits per group (bits 0-1 / 2-3: the kept positions, "
                     "increasing), group g at bits 4*(g%8) of word g//8; '<module>.weight_dense_packed' int32 "
                     "[dense rows, in/8] for the rows in dense_rows; weight_scale [out, in/group] and "
                     "weight_shape as pack-quantized. Sparse rows are all rows outside dense_rows, in order")


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """bool [out, in] -> uint8 [out, ceil(in/8)], little-endian bits (see SPARSITY_LAYOUT)."""
    out, n = mask.shape
    m = torch.nn.functional.pad(mask.to(torch.uint8), (0, -n % 8)).reshape(out, -1, 8)
    return (m << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8)


def unpack_mask(bits: torch.Tensor, in_features: int) -> torch.Tensor:
    m = (bits[..., None] >> torch.arange(8, dtype=torch.uint8)) & 1
    return m.reshape(bits.shape[0], -1)[:, :in_features].bool()


def row_ranges(rows: torch.Tensor) -> list[list[int]]:
    """bool [out] -> [[start, end), ...] of the True runs (how sparsity.json lists dense rows)."""
    idx = rows.nonzero().flatten().tolist()
    runs: list[list[int]] = []
    for i in idx:
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    return runs


def rows_from_ranges(ranges: list[list[int]], out_features: int) -> torch.Tensor:
    rows = torch.zeros(out_features, dtype=torch.bool)
    for start, end in ranges:
        rows[start:end] = True
    return rows


def sparsity_info(rel: Path) -> dict:
    """sparsity.json (with `storage`, `mask` for releases written before it existed), or {} if none."""
    p = rel / SPARSITY_JSON
    if not p.is_file():
        return {}
    info = json.loads(p.read_text())
    info.setdefault("storage", "mask")
    if info["storage"] not in STORAGES:
        raise SmeltError(f"{SPARSITY_JSON}: storage {info['storage']!r} is not one of {', '.join(STORAGES)}")
    return info


@dataclass
class ReleaseLinear:
    """One quantized Linear of a release, as stored (int4 symmetric, per-group scales)."""
    name: str
    shape: tuple[int, int]
    group_size: int
    scale: torch.Tensor                       # float [out, in / group_size]
    packed: torch.Tensor | None = None        # int32 [out, in/8]: every row (mask storage)
    keep: torch.Tensor | None = None          # bool [out, in]: declared 2:4 (mask storage)
    kept: torch.Tensor | None = None          # int32 [sparse rows, in/16] (compressed storage)
    meta: torch.Tensor | None = None          # int32 [sparse rows, in/32] (compressed storage)
    dense_packed: torch.Tensor | None = None  # int32 [dense rows, in/8] (compressed storage)
    dense_rows: torch.Tensor | None = None    # bool [out]: rows left dense in a 2:4 module

    @property
    def sparse(self) -> bool:
        return self.keep is not None or self.meta is not None

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices of the 2:4 rows, indices of the dense rows)."""
        dense = self.dense_rows if self.dense_rows is not None else torch.zeros(self.shape[0], dtype=torch.bool)
        return (~dense).nonzero().flatten(), dense.nonzero().flatten()

    def codes(self) -> torch.Tensor:
        """int8 [out, in]: the integer weight (pruned entries are code 0)."""
        out, inn = self.shape
        if self.packed is not None:
            return unpack_int4(self.packed, inn)
        q = torch.zeros(out, inn, dtype=torch.int8)
        sparse_idx, dense_idx = self.rows()
        q[sparse_idx] = unpack_24(unpack_int4(self.kept, inn // 2), self.meta, inn)
        if len(dense_idx):
            q[dense_idx] = unpack_int4(self.dense_packed, inn)
        return q

    def weight(self) -> torch.Tensor:
        """float32 [out, in] = codes * scale: the weight transformers decompresses and QAT trained (scaled in
        place, group by group: no second [out, in] temporary)."""
        out, inn = self.shape
        w = self.codes().float().view(out, inn // self.group_size, self.group_size)
        return w.mul_(self.scale.float()[:, :, None]).view(out, inn)


def check_compressed(where: str, t: dict[str, torch.Tensor], shape: tuple[int, int], n_dense: int) -> None:
    """One module's compressed-storage codes: present, int32, shaped as [out, in] and its dense-row count
    imply (SmeltError naming the tensor). The metadata's content is core.packing.unpack_24_positions's."""
    out, inn = shape
    want = {"weight_kept": (out - n_dense, inn // 16), "weight_meta": (out - n_dense, inn // 32)}
    if n_dense:
        want["weight_dense_packed"] = (n_dense, inn // 8)
    for k, s in want.items():
        got = t.get(k)
        if got is None or got.dtype != torch.int32 or tuple(got.shape) != s:
            have = "missing" if got is None else f"{got.dtype} {list(got.shape)}"
            raise SmeltError(f"{where}.{k} is {have}, want int32 {list(s)} (2:4-compressed, {n_dense} dense rows)")


def quant_args(config: dict) -> tuple[int, int]:
    """(bits, group_size) of a release's config.json, refusing what the int4 readers cannot run."""
    qc = config.get("quantization_config")
    if not qc:
        raise SmeltError("config.json has no quantization_config (not a smelt release)")
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1 or not groups[0].get("weights"):
        raise SmeltError("quantization_config: expected one config group with weights")
    w = groups[0]["weights"]
    if w.get("num_bits") != 4 or not w.get("symmetric") or w.get("strategy") != "group":
        raise SmeltError(f"quantization_config: int{w.get('num_bits')} {w.get('strategy')} "
                         f"{'sym' if w.get('symmetric') else 'asym'}: only int4 symmetric group-wise is read here")
    return 4, int(w["group_size"])


class ReleaseReader:
    """A release's quantized Linears read one module at a time (plain reads, no memory map), so a model larger
    than memory is checked and run a module at a time: `modules` (HF names), `tensors(mod)` (its stored
    tensors by suffix), `linear(mod)` (its ReleaseLinear), `model` (the reader of model.safetensors)."""

    def __init__(self, rel: str | Path):
        self.rel = Path(rel)
        self.config = json.loads((self.rel / "config.json").read_text())
        self.model = SafetensorsReader(self.rel / "model.safetensors")
        self.info = sparsity_info(self.rel)
        self.declared = self.info.get("modules", {})
        self._by_mod: dict[str, dict[str, str]] = {}
        for key in self.model.keys():  # noqa: SIM118 - a reader, not a dict
            mod, _, param = key.rpartition(".")
            if param.startswith("weight_"):
                self._by_mod.setdefault(mod, {})[param] = key
        self.modules = sorted(self._by_mod)
        masked = self.declared and self.info["storage"] == "mask"
        self._bits = SafetensorsReader(self.rel / self.info.get("file", SPARSITY_FILE)) if masked else None
        missing = sorted(set(self.declared) - set(self.modules))
        if missing:
            raise SmeltError(f"{SPARSITY_JSON} declares {missing[0]}, which has no quantized weight")

    def tensors(self, mod: str) -> dict[str, torch.Tensor]:
        return {param: self.model.get(key) for param, key in self._by_mod[mod].items()}

    def keep_bits(self, mod: str) -> torch.Tensor | None:
        key = f"{mod}.keep_bits"
        return self._bits.get(key) if self._bits is not None and key in self._bits else None

    def linear(self, mod: str) -> ReleaseLinear:
        _, group = quant_args(self.config)
        t = self.tensors(mod)
        if "weight_shape" not in t or "weight_scale" not in t:
            raise SmeltError(f"model.safetensors: {mod} lacks weight_shape/weight_scale")
        shape = tuple(int(x) for x in t["weight_shape"].tolist())
        lin = ReleaseLinear(mod, shape, group, t["weight_scale"])
        d = self.declared.get(mod)
        if d is not None and d.get("dense_rows"):
            lin.dense_rows = rows_from_ranges(d["dense_rows"], shape[0])
        if d is not None and self.info["storage"] == "compressed":
            lin.kept, lin.meta = t.get("weight_kept"), t.get("weight_meta")
            lin.dense_packed = t.get("weight_dense_packed")
            n_dense = 0 if lin.dense_rows is None else int(lin.dense_rows.sum())
            check_compressed(f"model.safetensors: {mod}", t, shape, n_dense)
        else:
            if "weight_packed" not in t:
                raise SmeltError(f"model.safetensors: {mod} lacks weight_packed")
            lin.packed = t["weight_packed"]
            if d is not None:
                bits = self.keep_bits(mod)
                if bits is None:
                    raise SmeltError(f"{SPARSITY_FILE}: no {mod}.keep_bits for the declared 2:4 module {mod}")
                lin.keep = unpack_mask(bits, shape[1])
        return lin


def read_release_linears(rel: str | Path) -> dict[str, ReleaseLinear]:
    """Every quantized Linear of a release (HF module names), in either 2:4 storage."""
    reader = ReleaseReader(rel)
    quant_args(reader.config)
    return {mod: reader.linear(mod) for mod in reader.modules}


class ReleaseWeights:
    """A release's weights by our parameter names, in fp32, a module at a time (models.source_model's
    source): quantized Linears decompressed as loaders do (codes x scales), the rest as shipped."""

    def __init__(self, reader: ReleaseReader):
        self.reader, self.quantized = reader, set(reader.modules)

    def _quantized(self, name: str) -> str | None:
        mod = to_hf_name(name).removesuffix(".weight")
        return mod if mod in self.quantized else None

    def get(self, name: str) -> torch.Tensor:
        mod = self._quantized(name)
        return self.reader.linear(mod).weight() if mod else self.reader.model.get(to_hf_name(name)).float()

    def rows(self, name: str, ids: list[int]) -> torch.Tensor:
        return self.get(name)[ids] if self._quantized(name) else self.reader.model.take(to_hf_name(name), ids).float()

    def row_blocks(self, name: str):
        if self._quantized(name):
            yield self.get(name)
            return
        for rows in self.reader.model.row_blocks(to_hf_name(name)):
            yield rows.float()
