"""The mask format: `masks.safetensors` in an artifact, one bool keep-mask per pruned module.

A mask is shaped like the module's weight, True = keep. Pruning writes it, recovery and QAT keep the
weights inside it (train.masks.MaskSet), PTQ never revives a removed weight, and the release packs it.

`<module>.weight_dense_rows` (bool [out_features], optional) declares rows the pruner left dense on
purpose (protected heads, core.protected): their mask row is all True and N:M checks skip them. Every
stage that rewrites masks carries the declaration through unchanged.
"""
from __future__ import annotations

from pathlib import Path

import torch

from core.errors import SmeltError
from core.hf_names import layer_index
from core.sidefiles import SideFileOnDisk, StreamedSideFile, load_side_file, save_side_file

MASKS_FILE = "masks.safetensors"
MASKS_FORMAT = "smelt-masks/1"


DENSE_ROWS = "weight_dense_rows"


def _mask_tensors(masks: dict[str, torch.Tensor], dense_rows: dict[str, torch.Tensor]) -> dict:
    """{(module, suffix): tensor} of masks and their declared dense rows (which must be all kept)."""
    tensors = {(k, ""): v.to(torch.bool) for k, v in masks.items()}
    for k, rows in dense_rows.items():
        if k not in masks or not bool(masks[k][rows.to(masks[k].device)].all()):
            raise SmeltError(f"{MASKS_FILE}: {k} declares dense rows its keep-mask prunes")
        tensors[(k, DENSE_ROWS)] = rows.to(torch.bool)
    return tensors


_MASKS_META = {"format": MASKS_FORMAT, "keep": "True"}


def save_masks(model, masks: dict[str, torch.Tensor], out_dir: str | Path,
               dense_rows: dict[str, torch.Tensor] | None = None) -> None:
    """Masks (and declared dense rows) under the HF module names of the saved weights (layers renumbered
    like save_hf)."""
    save_side_file(Path(out_dir) / MASKS_FILE, _mask_tensors(masks, dense_rows or {}), layer_index(model),
                   metadata=_MASKS_META)


class StreamedMasks(StreamedSideFile):
    """The masks file save_masks writes, written block by block as the masks are final (streamed
    calibration: the masks of a model larger than memory are never held whole). Layers keep their numbers."""

    def __init__(self, out_dir: str | Path, shapes: dict[str, tuple[int, ...]],
                 dense_rows: dict[str, torch.Tensor] | None = None):
        self.dense = dense_rows or {}
        layout = []
        for k, shape in shapes.items():
            layout.append(((k, ""), torch.bool, tuple(shape)))
            if k in self.dense:
                layout.append(((k, DENSE_ROWS), torch.bool, (int(shape[0]),)))
        super().__init__(Path(out_dir) / MASKS_FILE, layout, _MASKS_META)

    def write(self, masks: dict[str, torch.Tensor]) -> None:
        """Some modules' final masks (a block's), in any order."""
        super().write(_mask_tensors(masks, {k: self.dense[k] for k in masks if k in self.dense}))


def load_masks(art_dir: str | Path) -> dict[str, torch.Tensor]:
    """{our module name: bool keep-mask} from an artifact ({} when it has no masks file)."""
    p = Path(art_dir) / MASKS_FILE
    if not p.is_file():
        return {}
    tensors, _ = load_side_file(p)
    return {module: t.bool() for (module, suffix), t in tensors.items() if not suffix}


def load_dense_rows(art_dir: str | Path) -> dict[str, torch.Tensor]:
    """{our module name: bool [out_features]} rows declared dense ({} when none); the masks are not read."""
    p = Path(art_dir) / MASKS_FILE
    if not p.is_file():
        return {}
    f = SideFileOnDisk(p)
    return {module: f[(module, suffix)].bool() for module, suffix in f.keys() if suffix == DENSE_ROWS}  # noqa: SIM118 - a file, not a dict


class MasksOnDisk:
    """load_masks' mapping, read one mask at a time from the file (streamed stages never hold them all)."""

    def __init__(self, art_dir: str | Path):
        p = Path(art_dir) / MASKS_FILE
        self.file = SideFileOnDisk(p) if p.is_file() else None

    def __bool__(self) -> bool:
        return self.file is not None

    def __contains__(self, module: str) -> bool:
        return self.file is not None and (module, "") in self.file

    def __getitem__(self, module: str) -> torch.Tensor:
        if module not in self:
            raise KeyError(module)
        return self.file[(module, "")].bool()

    def names(self) -> list[str]:
        return [] if self.file is None else [m for m, suffix in self.file.keys() if not suffix]  # noqa: SIM118 - a file, not a dict

    def shape(self, module: str) -> tuple[int, ...]:
        return self.file.shape((module, ""))

    def part(self, module: str, slices: tuple[slice, ...]) -> torch.Tensor:
        """The part `slices` of a module's mask (a rank's shard: core.dtensor.local_slices), read alone."""
        return self.file.part((module, ""), slices).bool()
