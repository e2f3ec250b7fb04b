"""Release export: a quantized artifact -> a Hugging Face directory that serving stacks load without smelt.

    python -m qat.release --artifact runs/qat/final --out releases/model-w4 [--overwrite]

Weights go out in compressed-tensors' `pack-quantized` format (what vLLM and transformers load): per
quantized Linear int32 `weight_packed`, fp32 `weight_scale` [out, groups] and `weight_shape`, written by
compressed-tensors' own compressor from the exact integer codes of the artifact (symmetric int4/int8).
2:4 structure goes to our own `sparsity.safetensors` + `sparsity.json` (config.json keeps
`"sparsity_config": {}`, as recent vLLM rejects anything else). `smelt_release.json` records provenance
and the sha256 of every other file. Layout: docs/release-format.md.
"""
from __future__ import annotations

import functools
import json
import shutil
import time
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from core.artifact import read_manifest
from core.data import bucket_prompts
from core.device import return_freed_memory_at_once
from core.errors import ArgumentParser, SmeltError, run_cli
from core.files import atomic_dir, save_safetensors, sha256_file
from core.hf_names import to_hf_name
from core.masks import MASKS_FILE
from core.packing import pack_24, pack_int4, unpack_24_positions
from core.patterns import NMPattern
from core.release_layout import (COMPRESSED_LAYOUT, RELEASE_MANIFEST, SPARSITY_FILE, SPARSITY_JSON, SPARSITY_LAYOUT,
                                 STORAGES, pack_mask, read_release_linears, row_ranges, sparsity_info)
from core.safetensors_stream import StreamedSafetensors
from models.hf_io import config_from_hf, load_tokenizer, read_hf_config
from models.mtp import MTP_FILE, load_mtp, main_fingerprint, mtp_metadata
from models.source_model import source_model
from qat.artifact_tensors import SPARSE_24, ArtifactMasks, ArtifactTensors, ShippedWeights
from models.speculative import acceptance_probe
from qat.qparams import QPARAMS_FILE, read_qparams, spec_to_dict
from qat.quantizers import QuantSpec, check_group, dequantize, quantize

COMPRESSION_FORMAT = "pack-quantized"
# Copied through unchanged: tokenizer files, generation defaults, MTP heads of a later stage.
PASSTHROUGH = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
               "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
               "generation_config.json", "mtp.safetensors")
SERVING_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_MAX_CHAIN = 32  # manifest parent links followed at most (guards against cycles)


def ct_scheme(spec: QuantSpec):
    """compressed-tensors QuantizationScheme for our weight-only spec (W4A16 / W8A16, pack-quantized)."""
    # heavy (imports transformers): export only
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(**spec.ct_args(), dynamic=False)
    return QuantizationScheme(targets=["Linear"], weights=args, format=COMPRESSION_FORMAT)


def ct_quantization_config(spec: QuantSpec, ignore: list[str]) -> dict:
    """config.json's `quantization_config`, laid out as compressed-tensors' ModelCompressor writes it."""
    import compressed_tensors
    from compressed_tensors.quantization import QuantizationConfig  # heavy: see ct_scheme

    qc = QuantizationConfig(config_groups={"group_0": ct_scheme(spec)}, format=COMPRESSION_FORMAT,
                            quantization_status="compressed", ignore=ignore)
    return {"version": compressed_tensors.__version__, "quant_method": "compressed-tensors",
            "sparsity_config": {}, "transform_config": {},
            **qc.model_dump(mode="json", exclude={"quant_method"})}


def stage_chain(manifest: dict) -> list[dict]:
    """The stages that made the artifact, oldest first.

    A manifest's parent record ({"path", "stage", "settings"}, core.artifact.parent_record) is followed
    to the parent's own manifest while that still exists and still describes the same stage, so the
    chain reaches back to the source; a parent without a manifest (a downloaded teacher) ends it.
    """
    chain, node = [], manifest
    for _ in range(_MAX_CHAIN):
        chain.append({k: node[k] for k in ("stage", "created", "settings") if k in node})
        parent = node.get("parent")
        if not parent:
            break
        if "stage" not in parent:  # no manifest when it was recorded: the source (e.g. the teacher)
            chain.append({"stage": "source", **parent})
            break
        path = parent.get("path")
        on_disk = read_manifest(path) if path and (Path(path) / "manifest.json").is_file() else None
        if on_disk is None or (on_disk.get("stage"), on_disk.get("settings")) != (
                parent["stage"], parent.get("settings")):
            # Gone or replaced since: keep what the child recorded, and stop.
            chain.append({k: parent[k] for k in ("stage", "settings", "path") if k in parent})
            break
        node = on_disk
    return chain[::-1]


def integer_codes(name: str, w: torch.Tensor, scale: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Codes q with dequantize(q) == w, recovered from the stored weight; SmeltError if w is off-grid."""
    check_group(w.shape[1], spec.group_size, name)
    want = (w.shape[0], spec.n_groups(w.shape[1]))
    if tuple(scale.shape) != want:
        raise SmeltError(f"{QPARAMS_FILE}: {name} scale shape {tuple(scale.shape)} != {list(want)} "
                         f"(group_size={spec.group_size} per its metadata)")
    if not (torch.isfinite(scale).all() and (scale > 0).all()):
        raise SmeltError(f"{QPARAMS_FILE}: {name} has non-finite or non-positive scales")
    q = quantize(w.float(), scale, None, spec)
    deq = dequantize(q, scale, None, spec)
    # w was stored as dequantize(q) cast to its dtype: allow that dtype's rounding and nothing more
    # (an off-grid weight misses by up to half a step, orders of magnitude above this).
    s = scale.repeat_interleave(spec.group_width(w.shape[1]), dim=1)
    tol = 2 * torch.finfo(w.dtype).eps * torch.maximum(deq.abs(), s)
    if ((w.float() - deq).abs() > tol).any():
        raise SmeltError(f"weights of {name} are not on the int{spec.bits} grid of {QPARAMS_FILE} "
                         "(artifact broken)")
    return q


def compress_module(name: str, q: torch.Tensor, scale: torch.Tensor, spec: QuantSpec,
                    scheme) -> dict[str, torch.Tensor]:
    """compressed-tensors' own pack-quantized tensors for one Linear, checked to hold exactly q."""
    from compressed_tensors.compressors import PackedQuantizationCompressor

    # heavy: see ct_scheme
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    # Feeding dequantize(q) in fp32: the compressor's round(w / scale) gives back q exactly.
    sd = {"weight": dequantize(q, scale, None, spec), "weight_scale": scale}
    out = PackedQuantizationCompressor.compress(sd, scheme)
    if not torch.equal(unpack_from_int32(out["weight_packed"], spec.bits, q.shape), q):
        raise RuntimeError(f"{name}: compressed-tensors packed different codes than the artifact holds")
    return {f"{name}.{k}": v.contiguous() for k, v in out.items()}


def declared_pattern(chain: list[dict]) -> NMPattern | None:
    """The N:M pattern the latest prune stage of the chain declared, else None."""
    for st in reversed(chain):
        if st.get("stage") == "prune":
            pattern = (st.get("settings") or {}).get("pattern")  # None for unstructured sparsity
            return NMPattern.parse(pattern, "prune manifest settings.pattern") if pattern else None
    return None


def read_eval_metrics(path: str | Path, art: Path) -> dict:
    """An eval.evaluate --out file, checked to be about this artifact."""
    path = Path(path)
    if not path.is_file():
        raise SmeltError(f"--metrics {path} does not exist")
    ev = json.loads(path.read_text())
    if "buckets" not in ev or "model" not in ev:
        raise SmeltError(f"--metrics {path} is not an eval.evaluate --out file (no buckets/model)")
    evaluated = Path(ev["model"])
    # The evaluation measures the main model: one of another artifact holding the very same main model (MTP
    # modules trained on it, frozen) is this artifact's evaluation too.
    same = evaluated.resolve() == art.resolve() or ((evaluated / "config.json").is_file()
                                                    and main_fingerprint(evaluated) == main_fingerprint(art))
    if not same:
        raise SmeltError(f"--metrics {path} evaluated {ev['model']}, not the artifact {art} (nor its main model)")
    return ev


MTP_PROBE = {"buckets": ("en", "zh", "code"), "per_bucket": 2, "length": 64, "new_tokens": 32, "gamma": 1}


def _round_to(params, dtype: torch.dtype, keep: set[str]) -> None:
    """Round parameters (except `keep`) to the serving dtype in place: the probe runs the shipped values."""
    with torch.no_grad():
        for name, p in params:
            if name.removesuffix(".weight") not in keep and p.is_floating_point():
                p.copy_(p.to(dtype).to(p.dtype))


def mtp_record(art: Path, src: ArtifactTensors, dtype: torch.dtype, quantized: set[str]) -> dict | None:
    """What the release says about its MTP modules: depth, the main model they were trained against (and
    whether that is the released one), and their greedy acceptance on fixed prompts (the verifier re-runs
    it), measured with the weights as shipped: `quantized` Linears exact, the rest in `dtype` (a model larger
    than memory streams its blocks: models.source_model)."""
    meta = mtp_metadata(art)
    if meta is None:
        return None
    model = source_model(config_from_hf(read_hf_config(art)), ShippedWeights(src, dtype, quantized))
    heads = load_mtp(art, model, check_fingerprint=False)
    _round_to(heads.named_parameters(), dtype, set())
    tokenizer = load_tokenizer(art)
    p = MTP_PROBE
    prompts = [t[0].tolist() for b in p["buckets"] for t in bucket_prompts(tokenizer, b, p["per_bucket"], p["length"])]
    with torch.no_grad():
        probe = acceptance_probe(model, heads, prompts, p["new_tokens"], p["gamma"])
    own = main_fingerprint(art)
    return {"file": MTP_FILE, "depth": int(meta["depth"]), "fuse_layers": list(heads.fuse_layers),
            "trained_against": meta["main_fingerprint"],
            "released_main_model": own, "trained_on_released_model": meta["main_fingerprint"] == own,
            "probe": {**probe, "prompts": prompts}}


def compressed_24(name: str, q: torch.Tensor, keep: torch.Tensor, dense_rows: torch.Tensor | None,
                  packed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A 2:4 module's pack-quantized tensors -> the compressed storage (core.release_layout.COMPRESSED_LAYOUT):
    kept codes + position metadata for the 2:4 rows, full codes for declared dense rows."""
    dense = dense_rows if dense_rows is not None else torch.zeros(q.shape[0], dtype=torch.bool)
    kept, meta = pack_24(q[~dense], keep[~dense], name)
    out = {k: v for k, v in packed.items() if not k.endswith(".weight_packed")}
    out.update({f"{name}.weight_kept": pack_int4(kept), f"{name}.weight_meta": meta})
    if dense.any():
        out[f"{name}.weight_dense_packed"] = pack_int4(q[dense])
    return out


def _declared_sparsity(src: ArtifactTensors, art: Path, chain: list[dict]
                       ) -> tuple[dict[str, float], dict, ArtifactMasks]:
    """({2:4 module: density}, {module: dense rows}, the masks), every mask checked against its weight (shape,
    zeros where it prunes) and the pattern its prune stage declared before any weight is packed: a broken mask
    is a clearer diagnosis than the off-grid error it may also cause. Unstructured masks are enforced but not
    declared."""
    masks = ArtifactMasks(art)
    pattern, sparse = declared_pattern(chain), {}
    for name in masks.names:
        mask = masks.mask(name)
        if f"{name}.weight" not in src or src.shape(f"{name}.weight") != tuple(mask.shape):
            raise SmeltError(f"{MASKS_FILE}: {name} has no weight of shape {tuple(mask.shape)} in the model")
        rows = masks.dense_rows.get(name)
        if pattern and not pattern.holds(mask, rows):
            raise SmeltError(f"{MASKS_FILE}: {name} breaks the {pattern} pattern its prune stage declared")
        masks.check_zeros(name, src.get(f"{name}.weight"))
        if SPARSE_24.holds(mask, rows):
            sparse[name] = round(mask.float().mean().item(), 6)
    return sparse, masks.dense_rows, masks


def _module_layout(name: str, shape: tuple[int, int], spec: QuantSpec, compressed: bool,
                   dense_rows: torch.Tensor | None) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """The tensors compress_module (and compressed_24) write for one Linear, in the order they are written."""
    out_f, in_f = shape
    t = {"weight_scale": (torch.float32, (out_f, spec.n_groups(in_f))), "weight_shape": (torch.int64, (2,))}
    if compressed:
        nd = 0 if dense_rows is None else int(dense_rows.sum())
        t.update(weight_kept=(torch.int32, (out_f - nd, in_f // 16)), weight_meta=(torch.int32, (out_f - nd, in_f // 32)))
        if nd:
            t["weight_dense_packed"] = (torch.int32, (nd, in_f // 8))
    else:
        t["weight_packed"] = (torch.int32, (out_f, -(-in_f * spec.bits // 32)))
    return [(f"{name}.{k}", *t[k]) for k in sorted(t)]


def _write_sparsity(tmp: Path, modules: dict[str, tuple], storage: str) -> None:
    """sparsity.json (+ sparsity.safetensors keep-bits in the mask storage); modules: name -> (shape,
    density, dense_rows or None, a function giving the keep-mask), the masks read one at a time."""
    if storage == "mask":
        names = sorted(modules)
        stream = StreamedSafetensors(tmp / SPARSITY_FILE, [
            (f"{k}.keep_bits", torch.uint8, (modules[k][0][0], -(-modules[k][0][1] // 8))) for k in names],
            metadata={"format": "smelt-sparsity/1"})
        try:
            for k in names:
                mask = modules[k][3]
                stream.write(f"{k}.keep_bits", pack_mask(mask() if callable(mask) else mask))
            stream.close()
        except BaseException:
            stream.abort()
            raise
    (tmp / SPARSITY_JSON).write_text(json.dumps({
        "format": "smelt-sparsity/1", "pattern": str(SPARSE_24), "storage": storage,
        "file": SPARSITY_FILE if storage == "mask" else None,
        "layout": SPARSITY_LAYOUT if storage == "mask" else COMPRESSED_LAYOUT,
        "modules": {k: {"shape": shape, "density": density,
                        **({"dense_rows": row_ranges(rows)} if rows is not None else {})}
                    for k, (shape, density, rows, _) in sorted(modules.items())}}, indent=2) + "\n")


def _cast_safetensors(path: Path, dtype: torch.dtype) -> None:
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not a dict
    if all(v.dtype == dtype for v in tensors.values() if v.is_floating_point()):
        return  # already in it: the file stays byte for byte as trained
    save_safetensors({k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}, path, metadata=meta)


def build_release(artifact_dir: str | Path, out_dir: str | Path, overwrite: bool = False,
                  metrics_file: str | Path | None = None, dtype: str = "bfloat16",
                  sparse_storage: str = "mask") -> Path:
    """`dtype`: what the tensors that are not quantized (embeddings, norms, an untied head, Linears left
    dense, MTP modules) are shipped in; `sparse_storage`: how 2:4 modules are stored (STORAGES)."""
    art, out = Path(artifact_dir), Path(out_dir)
    if not art.is_dir():
        raise SmeltError(f"artifact directory {art} does not exist")
    if dtype not in SERVING_DTYPES:
        raise SmeltError(f"dtype {dtype!r} is not one of {', '.join(SERVING_DTYPES)}")
    if sparse_storage not in STORAGES:
        raise SmeltError(f"sparse_storage {sparse_storage!r} is not one of {', '.join(STORAGES)}")
    serve = SERVING_DTYPES[dtype]
    manifest = read_manifest(art)
    chain = stage_chain(manifest)
    metrics = dict(manifest.get("metrics") or {})
    if metrics_file is not None:
        metrics["eval"] = read_eval_metrics(metrics_file, art)
    qparams, spec = read_qparams(art)  # SmeltError if not quantized or bits not in (4, 8)
    if sparse_storage == "compressed" and spec.bits != 4:
        raise SmeltError(f"sparse_storage compressed packs int4 codes; this artifact is int{spec.bits}")
    if not spec.symmetric:
        # compressed-tensors 0.20 packs asymmetric zero points, but its own load path (transformers)
        # expects them unpacked and fails: such a release would not load anywhere we can test.
        raise SmeltError("asymmetric quantisation cannot be released (compressed-tensors pack-quantized "
                         "zero points do not load in transformers): quantise with symmetric: true")
    config = read_hf_config(art)
    if "quantization_config" in config:
        raise SmeltError(f"{art}/config.json already has a quantization_config (already a release?)")
    src = ArtifactTensors(art)
    sparse, dense_rows, masks = _declared_sparsity(src, art, chain)
    quantized = {to_hf_name(ours): ours for ours in qparams}
    for name in sorted(quantized):
        if f"{name}.weight" not in src:
            raise SmeltError(f"{QPARAMS_FILE} has scales for {name}, model.safetensors has no {name}.weight")
    compressed = {n for n in sparse if sparse_storage == "compressed" and n in quantized}
    kept = sorted(k for k in src.names if k.removesuffix(".weight") not in quantized)
    # Every Linear left dense must be ignored, else loaders expect packed weights for it.
    dense = sorted(k.removesuffix(".weight") for k in kept if len(src.shape(k)) == 2 and k.endswith("_proj.weight"))
    ignore = ([] if "output" in qparams else ["lm_head"]) + dense

    config["quantization_config"] = ct_quantization_config(spec, ignore)
    config["torch_dtype"] = dtype
    settings = {"quantization": {**spec_to_dict(spec), "format": COMPRESSION_FORMAT, "ignore": ignore,
                                 "modules": len(qparams)},
                "dtype": dtype,
                "sparsity": {"pattern": str(SPARSE_24), "modules": len(sparse), "storage": sparse_storage,
                             "undeclared_masks": sorted(set(masks.names) - set(sparse))} if masks.names else None,
                "source": str(art.resolve()),
                "mtp": mtp_record(art, src, serve, set(qparams))}
    layout = [e for name in sorted(quantized) for e in _module_layout(
        name, src.shape(f"{name}.weight"), spec, name in compressed, dense_rows.get(name))]
    layout += [(k, serve if src.dtype(k).is_floating_point else src.dtype(k), src.shape(k)) for k in kept]
    scheme = ct_scheme(spec)
    with atomic_dir(out, overwrite=overwrite) as tmp:
        stream = StreamedSafetensors(tmp / "model.safetensors", layout, metadata={"format": "pt"})
        # leave=False: a bar that an error interrupts is cleared, so a bad input stays one line on stderr
        try:
            with tqdm(sorted(quantized), desc="pack", unit="module", leave=False) as bar:
                for name in bar:
                    scale = qparams[quantized[name]][0].float()
                    q = integer_codes(name, src.get(f"{name}.weight"), scale, spec)
                    packed = compress_module(name, q, scale, spec, scheme)
                    if name in compressed:
                        packed = compressed_24(name, q, masks.mask(name), dense_rows.get(name), packed)
                    for key in sorted(packed):
                        stream.write(key, packed[key])
            for k in kept:  # embeddings, norms, an untied lm_head, Linears left dense: in the serving dtype
                for rows in src.row_blocks(k):
                    stream.write(k, rows.to(serve) if rows.is_floating_point() else rows, part=True)
            stream.close()
        except BaseException:
            stream.abort()
            raise
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if sparse:
            _write_sparsity(tmp, {k: (list(src.shape(f"{k}.weight")), density, dense_rows.get(k),
                                      functools.partial(masks.mask, k)) for k, density in sparse.items()},
                            sparse_storage)
        for f in PASSTHROUGH:
            if (art / f).is_file():
                shutil.copy2(art / f, tmp / f)
        if (tmp / MTP_FILE).is_file():  # non-quantized weights: the serving dtype too
            _cast_safetensors(tmp / MTP_FILE, serve)
        files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        (tmp / RELEASE_MANIFEST).write_text(json.dumps({
            "format": "smelt-release/1", "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "stages": chain, "settings": settings, "metrics": metrics,
            "files": files}, indent=2) + "\n")
    return out


def expand_release(rel_dir: str | Path, out_dir: str | Path, overwrite: bool = False) -> Path:
    """A release in the compressed 2:4 storage -> the same release in the mask storage (pack-quantized
    weight_packed of every row + keep-bits), which transformers and vLLM load. The weights are identical."""
    rel, out = Path(rel_dir), Path(out_dir)
    info = sparsity_info(rel) if rel.is_dir() else {}
    if info.get("storage") != "compressed":
        raise SmeltError(f"{rel} is not a release in the compressed 2:4 storage (nothing to expand)")
    linears = read_release_linears(rel)
    modules = {}
    with safe_open(str(rel / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not a dict
    for name, lin in linears.items():
        if lin.meta is None:
            continue
        out_f, in_f = lin.shape
        sparse_idx, dense_idx = lin.rows()
        keep = torch.zeros(out_f, in_f // 4, 4, dtype=torch.bool)
        keep[sparse_idx] = keep[sparse_idx].scatter(-1, unpack_24_positions(lin.meta, in_f), True)
        keep = keep.reshape(out_f, in_f)
        keep[dense_idx] = True
        for k in ("weight_kept", "weight_meta", "weight_dense_packed"):
            tensors.pop(f"{name}.{k}", None)
        tensors[f"{name}.weight_packed"] = pack_int4(lin.codes())
        modules[name] = (list(lin.shape), info["modules"][name]["density"], lin.dense_rows, keep)
    manifest = json.loads((rel / RELEASE_MANIFEST).read_text())
    with atomic_dir(out, overwrite=overwrite) as tmp:
        save_safetensors(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        _write_sparsity(tmp, modules, "mask")
        for p in rel.iterdir():
            if p.is_file() and p.name not in ("model.safetensors", SPARSITY_JSON, SPARSITY_FILE, RELEASE_MANIFEST):
                shutil.copy2(p, tmp / p.name)
        manifest["settings"]["sparsity"]["storage"] = "mask"
        manifest["expanded_from"] = {"path": str(rel.resolve()), "files": manifest["files"]}
        manifest["files"] = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        (tmp / RELEASE_MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(prog="python -m qat.release", description="Export a quantized artifact as a compressed-tensors release.")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--artifact", help="quantized artifact (with qparams.safetensors)")
    src.add_argument("--expand", metavar="RELEASE", help="rewrite a release in the compressed 2:4 storage into "
                     "the mask storage that transformers and vLLM load")
    ap.add_argument("--out", required=True, help="release directory to write")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing release directory")
    ap.add_argument("--metrics", help="an `eval.evaluate --out` JSON of this artifact, kept in the manifest")
    ap.add_argument("--dtype", choices=sorted(SERVING_DTYPES), default="bfloat16",
                    help="dtype of the tensors that are not quantized (embeddings, norms, MTP modules)")
    ap.add_argument("--sparse-storage", choices=STORAGES, default="mask",
                    help="2:4 modules as full pack-quantized rows + keep-bits (mask: loads in transformers/vLLM) "
                         "or as kept codes + position metadata (compressed: the kernels' layout, smaller)")
    args = ap.parse_args(argv)
    return_freed_memory_at_once()  # each module's tensors go back to the system when freed: a bounded peak
    if args.expand:
        out = expand_release(args.expand, args.out, overwrite=args.overwrite)
    else:
        out = build_release(args.artifact, args.out, overwrite=args.overwrite, metrics_file=args.metrics,
                            dtype=args.dtype, sparse_storage=args.sparse_storage)
    print(f"release written to {out} (check it with: python -m qat.verify {out})")


if __name__ == "__main__":
    run_cli(main)
