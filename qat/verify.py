"""Check a release directory written by qat.release before it is handed to serving.

    python -m qat.verify RELEASE

Prints a checklist; exits 0 when every check passes, 1 otherwise (one `FAIL` line per failure).
Checks: file sha256s against smelt_release.json; config.json's compressed-tensors quantization_config;
per quantized Linear the packing shapes (int32 weight_packed for weight_shape and bits, scale
[out, in/group]) and scale ranges (finite, > 0); that every declared 2:4 group of the *decompressed*
weights has at most 2 non-zeros, all inside the recorded mask; and that transformers loads it
(compressed-tensors decompresses on CPU) and a forward on a few tokens gives finite logits.
"""
from __future__ import annotations

import json
import math
import shutil
import tempfile
from pathlib import Path

import torch

from core.device import return_freed_memory_at_once
from core.errors import ArgumentParser, SmeltError, run_cli
from core.files import sha256_file
from core.packing import unpack_24_positions
from core.files import save_safetensors
from core.release_layout import (RELEASE_MANIFEST, SPARSITY_JSON, ReleaseReader, ReleaseWeights, check_compressed,
                                 rows_from_ranges, sparsity_info, unpack_mask)
from models.hf_io import config_from_hf
from models.mtp import MTP_FILE, load_mtp
from models.source_model import RESIDENT_BYTES, fp32_bytes, source_model
from models.speculative import acceptance_probe
from qat.release import COMPRESSION_FORMAT, SPARSE_24, expand_release

MTP_TOLERANCE = 0.05  # greedy acceptance is deterministic up to floating-point ties across machines


class Report:
    """Checklist lines; `fail(msg)` records one failure line, `ok(msg)` a passed check."""

    def __init__(self):
        self.lines: list[str] = []
        self.failures: list[str] = []

    def ok(self, msg: str) -> None:
        self.lines.append(f"  ok    {msg}")

    def fail(self, msg: str) -> None:
        self.lines.append(f"  FAIL  {msg}")
        self.failures.append(msg)


def _check_files(rel: Path, r: Report) -> None:
    p = rel / RELEASE_MANIFEST
    if not p.is_file():
        r.fail(f"{RELEASE_MANIFEST} is missing (not a smelt release)")
        return
    files = json.loads(p.read_text()).get("files", {})
    bad = 0
    for name, digest in sorted(files.items()):
        if not (rel / name).is_file():
            r.fail(f"{name}: listed in {RELEASE_MANIFEST} but missing")
        elif sha256_file(rel / name) != digest:
            r.fail(f"{name}: sha256 does not match {RELEASE_MANIFEST} (file modified or corrupt)")
        else:
            continue
        bad += 1
    for extra in sorted(f.name for f in rel.iterdir() if f.is_file() and f.name not in files):
        if extra != RELEASE_MANIFEST:
            r.fail(f"{extra}: not listed in {RELEASE_MANIFEST}")
            bad += 1
    if not bad:
        r.ok(f"sha256 of {len(files)} files match {RELEASE_MANIFEST}")


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def _scheme(rel: Path, r: Report):
    """The release's single weight QuantizationScheme, or None (with a failure) if config.json is off."""
    # heavy (imports transformers): checks only
    from compressed_tensors.quantization import QuantizationConfig

    try:
        qc = json.loads((rel / "config.json").read_text())["quantization_config"]
        skip = ("version", "sparsity_config", "transform_config")  # not QuantizationConfig fields
        cfg = QuantizationConfig.model_validate({k: v for k, v in qc.items() if k not in skip})
    except Exception as e:  # noqa: BLE001 - any parse error is a failed check, reported in one line
        r.fail(f"config.json: no valid compressed-tensors quantization_config ({_first_line(e)})")
        return None
    problems = []
    if qc.get("sparsity_config") != {}:
        problems.append('"sparsity_config" must be {} (vLLM rejects other values)')
    if cfg.format != COMPRESSION_FORMAT or cfg.quantization_status != "compressed":
        problems.append(f"format/status {cfg.format}/{cfg.quantization_status}, "
                        f"want {COMPRESSION_FORMAT}/compressed")
    if len(cfg.config_groups) != 1:
        problems.append(f"{len(cfg.config_groups)} config groups, expected 1")
    elif not getattr(next(iter(cfg.config_groups.values())).weights, "symmetric", False):
        problems.append("weights must be symmetrically quantised (smelt releases are)")
    for p in problems:
        r.fail(f"config.json: {p}")
    if problems:
        return None
    scheme = next(iter(cfg.config_groups.values()))
    w = scheme.weights
    r.ok(f"config.json: compressed-tensors {COMPRESSION_FORMAT}, int{w.num_bits} {w.strategy} "
         f"group_size={w.group_size} {'sym' if w.symmetric else 'asym'}, ignore={cfg.ignore}")
    return scheme


def _check_packing(reader: ReleaseReader, scheme, r: Report) -> set[str]:
    """The modules that failed: shapes, dtypes and scale ranges of every quantized module, one at a time."""
    w = scheme.weights
    bad = set()
    compressed = reader.declared if reader.info.get("storage") == "compressed" else {}
    for mod in reader.modules:
        t = reader.tensors(mod)
        if mod in compressed:  # kept codes + metadata (core.release_layout.COMPRESSED_LAYOUT)
            try:
                _check_compressed(mod, t, compressed[mod], w)
            except SmeltError as e:
                r.fail(str(e))
                bad.add(mod)
            continue
        if not {"weight_packed", "weight_scale", "weight_shape"} <= set(t):
            r.fail(f"{mod}: needs weight_packed, weight_scale and weight_shape, has {sorted(t)}")
            bad.add(mod)
            continue
        out, inn = (int(x) for x in t["weight_shape"].tolist())
        groups = 1 if w.group_size is None else inn / w.group_size
        want_packed = (out, math.ceil(inn * w.num_bits / 32))
        scale = t["weight_scale"]
        errs = []
        if t["weight_packed"].dtype != torch.int32 or tuple(t["weight_packed"].shape) != want_packed:
            errs.append(f"weight_packed is {t['weight_packed'].dtype} {tuple(t['weight_packed'].shape)}, "
                        f"want int32 {want_packed} for int{w.num_bits} {[out, inn]}")
        if groups != int(groups) or tuple(scale.shape) != (out, int(groups)):
            errs.append(f"weight_scale shape {tuple(scale.shape)} does not match [out, in/group] = "
                        f"[{out}, {inn}/{w.group_size}]")
        elif not (torch.isfinite(scale).all() and (scale > 0).all()):
            errs.append(f"{int((~torch.isfinite(scale) | (scale <= 0)).sum())} scales are non-finite or <= 0")
        for e in errs:
            r.fail(f"{mod}: {e}")
        if errs:
            bad.add(mod)
    if not reader.modules:
        r.fail("model.safetensors holds no packed weights")
    elif not bad:
        r.ok(f"packing: {len(reader.modules)} modules with int32 weight_packed, scales [out, in/group], all finite > 0")
    return bad


def _check_compressed(mod: str, t: dict[str, torch.Tensor], info: dict, w) -> None:
    """Shapes and metadata of one module in the compressed 2:4 storage; SmeltError naming what is wrong."""
    if w.num_bits != 4 or not {"weight_scale", "weight_shape"} <= set(t):
        raise SmeltError(f"{mod}: the compressed 2:4 storage needs int4 codes, weight_scale and weight_shape, "
                         f"has {sorted(t)}")
    out, inn = (int(x) for x in t["weight_shape"].tolist())
    check_compressed(mod, t, (out, inn), int(rows_from_ranges(info.get("dense_rows", []), out).sum()))
    scale = t["weight_scale"]
    if tuple(scale.shape) != (out, inn // w.group_size):
        raise SmeltError(f"{mod}: weight_scale is {list(scale.shape)}, want {[out, inn // w.group_size]}")
    if not (torch.isfinite(scale).all() and (scale > 0).all()):
        raise SmeltError(f"{mod}: {int((~torch.isfinite(scale) | (scale <= 0)).sum())} scales are non-finite or <= 0")
    unpack_24_positions(t["weight_meta"], inn)  # increasing positions in every group


def _check_sparsity(reader: ReleaseReader, scheme, bad_mods: set[str], r: Report) -> None:
    from compressed_tensors.compressors import PackedQuantizationCompressor  # heavy: see _scheme

    if not (reader.rel / SPARSITY_JSON).is_file():
        r.ok("sparsity: none declared")
        return
    meta = reader.info
    if meta["storage"] == "compressed":
        _check_compressed_sparsity(reader, meta, bad_mods, r)
        return
    n_bad, skipped = 0, 0
    for mod, info in sorted(meta["modules"].items()):
        if mod in bad_mods:  # its packing failure is reported already; it cannot be decompressed
            skipped += 1
            continue
        bits = reader.keep_bits(mod)
        if bits is None:
            r.fail(f"{mod}: declared 2:4 but {meta['file']} has no {mod}.keep_bits")
            n_bad += 1
            continue
        mask = unpack_mask(bits, info["shape"][1])
        if mod in reader.modules:  # decompress exactly as loaders do: the weights are what must be sparse
            weight = PackedQuantizationCompressor.decompress(reader.tensors(mod), scheme)["weight"]
        else:
            weight = reader.model.get(f"{mod}.weight")
        if tuple(weight.shape) != tuple(mask.shape):
            r.fail(f"{mod}: weight shape {tuple(weight.shape)} != mask shape {tuple(mask.shape)}")
            n_bad += 1
            continue
        dense = rows_from_ranges(info.get("dense_rows", []), weight.shape[0])  # declared dense: no 2:4
        over = int(((weight[~dense] != 0).reshape(-1, 4).sum(-1) > 2).sum())
        outside = int((weight[~mask] != 0).sum())
        if over:
            r.fail(f"{mod}: {over} groups of 4 have more than 2 non-zero weights (declared 2:4)")
        if outside:
            r.fail(f"{mod}: {outside} weights are non-zero where the 2:4 mask removes them")
        mask_ok = SPARSE_24.holds(mask, dense) and bool(mask[dense].all())
        if not mask_ok:
            r.fail(f"{mod}: the mask in {meta['file']} keeps more than 2 of 4 somewhere")
        n_bad += bool(over or outside or not mask_ok)
    if skipped:
        r.lines.append(f"  skip  sparsity of {skipped} modules with invalid packing")
    if not n_bad and len(meta["modules"]) > skipped:
        r.ok(f"sparsity: {len(meta['modules']) - skipped} modules are 2:4 in their decompressed weights "
             "and masks")


def _check_compressed_sparsity(reader: ReleaseReader, meta: dict, bad_mods: set[str], r: Report) -> None:
    """The compressed storage holds 2:4 by construction; decompress anyway and count, as loaders would see it."""
    n_bad = 0
    for mod, info in sorted(meta["modules"].items()):
        if mod in bad_mods:
            continue
        try:
            q = reader.linear(mod).codes()
        except SmeltError as e:
            r.fail(f"reading the compressed 2:4 module {mod}: {e}")
            n_bad += 1
            continue
        dense = rows_from_ranges(info.get("dense_rows", []), q.shape[0])
        over = int(((q[~dense] != 0).reshape(-1, 4).sum(-1) > 2).sum())
        if over:
            r.fail(f"{mod}: {over} groups of 4 have more than 2 non-zero weights (declared 2:4)")
            n_bad += 1
    if not n_bad:
        r.ok(f"sparsity: {len(meta['modules']) - len(bad_mods & set(meta['modules']))} modules in the compressed "
             "2:4 storage decompress to 2:4")


CUT_VOCAB = 4096  # vocabulary rows the transformers load keeps of a model too large to load whole


def _cut_release(rel: Path, out: Path) -> Path:
    """The release's first block, final norm and first CUT_VOCAB embedding and head rows as a release of its own
    (config.json says 1 block and CUT_VOCAB tokens): what transformers loads of a model too large for memory."""
    reader = ReleaseReader(rel)
    config = dict(reader.config, num_hidden_layers=1)
    head_quantized = "lm_head" in reader.modules
    if not head_quantized:
        config["vocab_size"] = min(CUT_VOCAB, int(config["vocab_size"]))
    parts = ("model.layers.0.", "model.norm.", "model.embed_tokens.", "lm_head.")
    keep = [k for k in reader.model.keys() if k.startswith(parts)]  # noqa: SIM118 - a reader, not a dict
    out.mkdir(parents=True)
    tensors = {}
    for k in keep:
        cut = k in ("model.embed_tokens.weight", "lm_head.weight") and not head_quantized
        tensors[k] = reader.model.rows(k, 0, config["vocab_size"]) if cut else reader.model.get(k)
    save_safetensors(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    info = reader.info
    if info:
        modules = {m: v for m, v in info["modules"].items() if m.startswith("model.layers.0.")}
        (out / SPARSITY_JSON).write_text(json.dumps({**info, "modules": modules}, indent=2) + "\n")
        if info["storage"] == "mask":
            save_safetensors({f"{m}.keep_bits": reader.keep_bits(m) for m in modules}, out / info["file"],
                             metadata={"format": "smelt-sparsity/1"})
    shutil.copy2(rel / RELEASE_MANIFEST, out / RELEASE_MANIFEST)  # qat.release --expand reads its settings
    return out


def _check_load(rel: Path, r: Report, n_tokens: int = 8) -> None:
    """transformers loads the release and gives finite logits. A model whose fp32 weights pass
    models.source_model.RESIDENT_BYTES is loaded cut to its first block and CUT_VOCAB tokens, and the whole
    of it runs decompressed a block at a time instead, so that the check fits in memory."""
    from transformers import AutoModelForCausalLM  # heavy: only the load check

    cfg = config_from_hf(json.loads((rel / "config.json").read_text()))
    whole = fp32_bytes(cfg) <= RESIDENT_BYTES
    ids = (torch.arange(n_tokens) * 7919 % cfg.vocab_size)[None]  # a few spread-out token ids
    with tempfile.TemporaryDirectory() as tmp:
        loaded = rel
        try:
            if not whole:
                loaded = _cut_release(rel, Path(tmp) / "cut")
            if sparsity_info(loaded).get("storage") == "compressed":  # loaders read it through the converter
                loaded = expand_release(loaded, Path(tmp) / "expanded")
        except Exception as e:  # noqa: BLE001 - a failed conversion is a failed check
            r.fail(f"preparing the release for transformers failed: {_first_line(e)}")
            return
        if loaded.name == "expanded":
            r.ok("qat.release --expand converts the compressed 2:4 storage for transformers")
        try:
            model = AutoModelForCausalLM.from_pretrained(str(loaded), dtype=torch.float32).eval()
            with torch.no_grad():
                logits = model(ids % model.config.vocab_size).logits
        except Exception as e:  # noqa: BLE001 - a load failure is a failed check, not a crash
            r.fail(f"transformers load/forward failed: {_first_line(e)}")
            return
    if not torch.isfinite(logits).all():
        r.fail("transformers forward gives non-finite logits")
        return
    part = "" if whole else f" its first block and {model.config.vocab_size} vocabulary rows (the whole is too large)"
    r.ok(f"transformers {type(model).__name__} loads{part} and gives finite logits on {n_tokens} tokens")
    del model  # a block of a large model: not held through the streamed forward below
    if whole:
        return
    try:
        with torch.no_grad():
            logits = source_model(cfg, ReleaseWeights(ReleaseReader(rel)))(ids)
    except Exception as e:  # noqa: BLE001 - a failed forward is a failed check
        r.fail(f"the decompressed model's forward failed: {_first_line(e)}")
        return
    if not torch.isfinite(logits).all():
        r.fail("the decompressed model gives non-finite logits")
    else:
        r.ok(f"the whole decompressed model, read a block at a time, gives finite logits on {n_tokens} tokens")


def _check_mtp(rel: Path, r: Report, load: bool) -> None:
    """The MTP file: shapes for this main model (load_mtp checks them), and the recorded greedy acceptance
    reproduced on the release's own decompressed weights (alpha within MTP_TOLERANCE)."""
    rec = (json.loads((rel / RELEASE_MANIFEST).read_text()).get("settings") or {}).get("mtp")
    if rec is None:
        if (rel / MTP_FILE).is_file():
            r.fail(f"{MTP_FILE} is in the release but smelt_release.json has no settings.mtp")
        return
    if not load:
        r.lines.append("  skip  MTP acceptance (--no-load)")
        return
    try:
        cfg = config_from_hf(json.loads((rel / "config.json").read_text()))
        model = source_model(cfg, ReleaseWeights(ReleaseReader(rel)))
        heads = load_mtp(rel, model, check_fingerprint=False)
        recorded = {"depth": rec.get("depth"), "fuse_layers": rec.get("fuse_layers", [])}  # [] before fused modules
        for key, got in (("depth", heads.depth), ("fuse_layers", list(heads.fuse_layers))):
            if recorded[key] != got:
                raise SmeltError(f"settings.mtp.{key}={recorded[key]!r} in smelt_release.json, the file holds {got!r}")
        p = rec["probe"]
        with torch.no_grad():
            got = acceptance_probe(model, heads, p["prompts"], p["new_tokens"], p["gamma"])
    except Exception as e:  # noqa: BLE001 - a bad MTP file is a failed check
        r.fail(f"MTP modules: {_first_line(e)}")
        return
    if abs(got["alpha_first"] - p["alpha_first"]) > MTP_TOLERANCE:
        r.fail(f"MTP acceptance {got['alpha_first']:.3f} != recorded {p['alpha_first']:.3f} "
               f"(tolerance {MTP_TOLERANCE})")
    else:
        r.ok(f"MTP depth {rec['depth']}: greedy acceptance {got['alpha_first']:.3f} reproduces the recorded "
             f"{p['alpha_first']:.3f} on {len(p['prompts'])} prompts")


def verify_release(release_dir: str | Path, load: bool = True) -> Report:
    """Run every check (`load=False` skips the transformers load); never raises for a bad release."""
    rel, r = Path(release_dir), Report()
    if not (rel / "config.json").is_file() or not (rel / "model.safetensors").is_file():
        r.fail(f"{rel} has no config.json/model.safetensors (not a release directory)")
        return r
    _check_files(rel, r)
    scheme = _scheme(rel, r)
    if scheme is not None:
        try:
            reader = ReleaseReader(rel)
            _check_sparsity(reader, scheme, _check_packing(reader, scheme, r), r)
        except Exception as e:  # noqa: BLE001 - e.g. a corrupt safetensors header
            r.fail(f"reading tensors failed: {_first_line(e)}")
    if load:
        _check_load(rel, r)
    _check_mtp(rel, r, load)
    return r


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m qat.verify", description="Verify a smelt release directory (see docs/release-format.md).")
    ap.add_argument("release")
    ap.add_argument("--no-load", action="store_true", help="skip the transformers load + forward check")
    args = ap.parse_args(argv)
    return_freed_memory_at_once()  # each module's tensors go back to the system when freed: a bounded peak
    r = verify_release(args.release, load=not args.no_load)
    print(f"verify {args.release}")
    print("\n".join(r.lines))
    print(f"{'FAILED' if r.failures else 'PASSED'}: {len(r.failures)} failure(s)")
    return 1 if r.failures else 0


if __name__ == "__main__":
    run_cli(main)
