"""`hf:` datasets fetched ahead of the jobs (`smelt prefetch`), then read from the local cache.

One source is one config's split: its files go into the Hugging Face hub cache (HF_HOME / HF_HUB_CACHE, as
`huggingface_hub` downloads them), and a JSON record under $SMELT_CACHE/hub/ names the repository revision, the
files and the `datasets` builder that reads them. core.text_source streams a source whose record and files are
all there from those files, with or without network; under SMELT_OFFLINE=1 one that is not there is a one-line
error (core.fetch.offline_message).
"""
from __future__ import annotations

import glob
import json
import re
from pathlib import Path
from urllib.parse import unquote

from core.errors import SmeltError
from core.fetch import cache_root, offline, offline_message
from core.files import atomic_write_text, read_json

# what `datasets` names a hub data file: hf://datasets/<repo>@<revision>/<path in the repository>
HFFS = re.compile(r"^hf://datasets/(?P<repo>[^@]+)@(?P<rev>[^/]+)/(?P<path>.+)$")


def label(name: str, config: str | None, split: str) -> str:
    return f"hf:{name}{':' + config if config else ''} (split {split})"


def record_path(name: str, config: str | None, split: str) -> Path:
    key = re.sub(r"[^A-Za-z0-9_.-]", "-", f"{name.replace('/', '--')}--{config or 'default'}--{split}")
    return cache_root() / "hub" / f"{key}.json"


def local_files(name: str, config: str | None, split: str) -> tuple[str, list[str]] | None:
    """(builder, local file paths) of a fetched split; None when its record or any of its files is missing."""
    from huggingface_hub import try_to_load_from_cache

    path = record_path(name, config, split)
    if not path.is_file():
        return None
    rec = read_json(path, "a prefetched dataset record")
    files = [try_to_load_from_cache(rec["repo"], f, revision=rec["revision"], repo_type="dataset")
             for f in rec["files"]]
    return (rec["builder"], files) if files and all(isinstance(f, str) for f in files) else None


def fetch(name: str, config: str | None, split: str) -> tuple[bool, list[str]]:
    """Download one split's files into the hub cache and record them: (whether anything was downloaded, the
    local files). A split already fetched is not looked up again."""
    have = local_files(name, config, split)
    if have is not None:
        return False, have[1]
    if offline():
        raise SmeltError(offline_message(f"dataset {label(name, config, split)}", record_path(name, config, split)))
    import datasets
    from huggingface_hub import snapshot_download

    builder = datasets.load_dataset_builder(name, config)
    data_files = builder.config.data_files or {}
    if split not in data_files:
        raise SmeltError(f"{label(name, config, split)}: the dataset has no such split (splits: "
                         f"{', '.join(data_files) or 'none'})")
    found = [HFFS.match(str(f)) for f in data_files[split]]
    where = {(m["repo"], unquote(m["rev"])) for m in found if m}
    if not found or not all(found) or len(where) != 1:
        raise SmeltError(f"{label(name, config, split)}: its files are not all in one dataset repository revision "
                         f"({data_files[split][0] if data_files[split] else 'none'}); download them yourself and give "
                         f"their folder as the source")
    ((repo, revision),) = where
    files = [m["path"] for m in found]
    folder = snapshot_download(repo, repo_type="dataset", revision=revision,
                               allow_patterns=[glob.escape(f) for f in files])  # tqdm bars of huggingface_hub
    rec = {"source": label(name, config, split), "repo": repo, "revision": Path(folder).name, "files": files,
           "builder": type(builder).__module__.rsplit(".", 1)[-1]}  # datasets.packaged_modules.json.json -> json
    atomic_write_text(record_path(name, config, split), json.dumps(rec, indent=1) + "\n")
    have = local_files(name, config, split)
    if have is None:
        raise SmeltError(f"{label(name, config, split)}: downloaded, yet its files are not in the hub cache "
                         f"({folder})")
    return True, have[1]
