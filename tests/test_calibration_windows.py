"""Calibration windows: disjoint sampling (no token twice, seeded, every corpus of a mix, a one-line error when the
corpora cannot hold them), overlapping sampling as the original formula drew it, the setting checked where it enters,
and the recipe's dry run counting the distinct corpus tokens its calibrating stages read."""
from __future__ import annotations

import itertools
import json

import pytest
import torch
from conftest import ROOT

from configs.recipe import main
from configs.recipe_spec import load
from core.calibrate import CalibConfig
from core.data import (
    _with_bos,
    bos_id,
    calibration_windows,
    corpus_tokens,
    distinct_tokens,
    split_windows,
    window_starts,
)
from core.errors import SmeltError, run_cli
from models.hf_io import config_to_hf
from models.llama import FLAVORS

RECIPES = ROOT / "configs" / "recipes"
MIX = "wikitext2-valid+code-train"


def _positions(starts: list[list[int]], seq_len: int) -> set[tuple[int, int]]:
    """Every (corpus, position) the windows cover, counted the slow way."""
    return {(c, p) for c, part in enumerate(starts) for s in part for p in range(s, s + seq_len - 1)}


def _old_windows(tokenizer, n: int, seq_len: int, seed: int, corpus: str) -> torch.Tensor:
    """calibration_windows' formula before the sampling setting: one generator, randint offsets corpus by corpus."""
    names = corpus.split("+")
    span, g, parts = seq_len - 1, torch.Generator().manual_seed(seed), []
    for i, name in enumerate(names):
        count = n // len(names) + (i < n % len(names))
        ids = corpus_tokens(tokenizer, name)
        starts = torch.randint(0, len(ids) - span, (count,), generator=g)
        parts += [ids[s:s + span] for s in starts.tolist()]
    return _with_bos(torch.stack(parts), bos_id(tokenizer))


@pytest.mark.parametrize("lengths,n,seq_len", [([("a", 1000)], 7, 33), ([("a", 500), ("b", 130), ("c", 2000)], 10, 12),
                                               ([("a", 70), ("b", 64)], 8, 17)])  # the last: every slot taken
def test_disjoint_starts_share_no_token_and_are_seeded(lengths, n, seq_len):
    span = seq_len - 1
    for seed in range(5):
        starts = window_starts(lengths, n, seq_len, seed, "disjoint")
        assert [len(p) for p in starts] == split_windows(n, len(lengths))  # every corpus of the mix gets its share
        for part, (_, length) in zip(starts, lengths, strict=True):
            assert part == sorted(part) and all(b - a >= span for a, b in itertools.pairwise(part))
            assert part[0] >= 0 and part[-1] + span <= length
        assert distinct_tokens(starts, seq_len) == len(_positions(starts, seq_len)) == n * span
        assert window_starts(lengths, n, seq_len, seed, "disjoint") == starts
    draws = {str(window_starts(lengths, n, seq_len, seed, "disjoint")) for seed in range(5)}
    assert len(draws) > 1  # the seed chooses the slots (and their phase)


def test_disjoint_windows_are_the_corpus_text_and_deterministic(byte_tokenizer):
    a = calibration_windows(byte_tokenizer, 7, 48, seed=3, corpus=MIX, sampling="disjoint")
    assert a.shape == (7, 48) and (a[:, 0] == byte_tokenizer.bos_token_id).all()
    assert torch.equal(a, calibration_windows(byte_tokenizer, 7, 48, seed=3, corpus=MIX, sampling="disjoint"))
    assert not torch.equal(a, calibration_windows(byte_tokenizer, 7, 48, seed=4, corpus=MIX, sampling="disjoint"))
    lengths = [(name, len(corpus_tokens(byte_tokenizer, name))) for name in MIX.split("+")]
    starts = window_starts(lengths, 7, 48, 3, "disjoint")
    rows = [corpus_tokens(byte_tokenizer, name)[s:s + 47] for (name, _), part in zip(lengths, starts, strict=True)
            for s in part]
    assert torch.equal(a[:, 1:], torch.stack(rows))  # 4 windows of wikitext2-valid, then 3 of code-train


def test_too_many_disjoint_windows_is_one_line_naming_the_setting_and_what_fits(byte_tokenizer):
    fields = ("stages[2].calib_windows", "stages[2].calib_seq_len")
    with pytest.raises(SmeltError) as e:  # zh-train holds 100 // 10 = 10 windows; 30 split as 15 + 15
        window_starts([("wikitext2-valid", 1000), ("zh-train", 100)], 30, 11, 0, "disjoint", fields)
    assert str(e.value) == ("stages[2].calib_windows=30 disjoint windows of stages[2].calib_seq_len=11 do not fit: "
                            "corpus zh-train (100 tokens) holds 10, 15 asked; at most 21 fit over 2 corpora")
    window_starts([("wikitext2-valid", 1000), ("zh-train", 100)], 21, 11, 0, "disjoint")  # 11 + 10: fits
    with pytest.raises(SmeltError, match=r"21 .* holds 10, 11 asked; at most 20 fit"):
        window_starts([("wikitext2-valid", 100), ("zh-train", 1000)], 21, 11, 0, "disjoint")  # the first takes 11
    code = len(corpus_tokens(byte_tokenizer, "code-train"))
    cfg = CalibConfig(n_windows=2 * (code // 511) + 2, seq_len=512, corpus=MIX, sampling="disjoint")
    with pytest.raises(SmeltError, match=r"^--calib-windows=\d+ disjoint windows of --calib-seq-len=512 do not fit: "
                                         rf"corpus code-train \({code} tokens\) holds {code // 511}, "
                                         rf"{code // 511 + 1} asked; at most \d+ fit over 2 corpora$"):
        cfg.windows(byte_tokenizer)


@pytest.mark.parametrize("n,seq_len,seed,corpus", [(6, 64, 1, "wikitext2-valid"), (5, 48, 0, MIX),
                                                   (9, 33, 7, "code-train+wikitext2-valid"),
                                                   (4, 40, 2, "code-train+code-train")])
def test_overlapping_windows_are_the_original_formulas(byte_tokenizer, n, seq_len, seed, corpus):
    old = _old_windows(byte_tokenizer, n, seq_len, seed, corpus)
    assert torch.equal(calibration_windows(byte_tokenizer, n, seq_len, seed, corpus), old)  # the default
    assert torch.equal(calibration_windows(byte_tokenizer, n, seq_len, seed, corpus, "overlapping"), old)
    cfg = CalibConfig(n_windows=n, seq_len=seq_len, seed=seed, corpus=corpus)
    assert cfg.sampling == "overlapping" and torch.equal(cfg.windows(byte_tokenizer), old)  # every CLI's default


def test_an_unknown_sampling_is_refused_naming_the_field(capsys, tmp_path):
    with pytest.raises(SmeltError, match=r"^calibration sampling='random' is not one of disjoint, overlapping$"):
        CalibConfig(sampling="random")
    with pytest.raises(SmeltError, match=r"^data.calibration_sampling 'random' is not one of disjoint, overlapping$"):
        load(RECIPES / "smollm2-cpu.toml", ["data.calibration_sampling=random"])
    assert load(RECIPES / "smollm2-cpu-smoke.toml").data.calibration_sampling == "overlapping"  # from its base
    assert load(RECIPES / "smollm2-cpu-mtp.toml").data.calibration_sampling == "overlapping"
    assert load(RECIPES / "debug.toml").data.calibration_sampling == "overlapping"
    assert load(RECIPES / "llama3.1-8b-h100.toml").data.calibration_sampling == "disjoint"
    text = (RECIPES / "smollm2-cpu.toml").read_text().replace('calibration_sampling = "overlapping"', "")
    (tmp_path / "r.toml").write_text(text)
    assert load(tmp_path / "r.toml").data.calibration_sampling == "disjoint"  # a recipe that does not say


def _plan(capsys, tmp_path, recipe, *sets, stage: str | None = None) -> tuple[int, str, str, dict | None]:
    out = tmp_path / "plan.json"
    argv = [str(recipe), "--dry-run", "--json", str(out), *[x for s in sets for x in ("--set", s)],
            *(["--stage", stage] if stage else [])]
    try:
        run_cli(lambda: main(argv))
        code = 0
    except SystemExit as e:
        code = e.code
    io = capsys.readouterr()
    plan = json.loads(out.read_text()) if out.is_file() else None
    out.unlink(missing_ok=True)
    return code, io.out, io.err, plan


def _teacher(where, tokenizer):
    where.mkdir(parents=True)
    (where / "config.json").write_text(json.dumps(config_to_hf(FLAVORS["smollm2-135m"])))
    tokenizer.save_pretrained(where)
    return where


def test_the_8b_dry_run_counts_disjoint_windows_without_the_teacher(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    code, out, err, plan = _plan(capsys, tmp_path, RECIPES / "llama3.1-8b-h100.toml")
    assert code == 0, err
    stages = {s["name"]: s for s in plan["stages"]}
    for name, windows, seq_len in (("heads", 16, 512), ("prune", 96, 2048), ("quantize", 96, 2048)):
        c = stages[name]["calibration"]
        assert (c["windows"], c["seq_len"], c["sampling"]) == (windows, seq_len, "disjoint")
        assert c["distinct_tokens"] == windows * (seq_len - 1) and c["tokens"] == windows * seq_len
        assert " --calib-sampling disjoint " in stages[name]["commands"][0]
    assert "calibration" not in stages["qat-text"] and "calibration" not in stages["recover"]
    assert ("calibration wikitext2-valid+code-train+zh-train, disjoint windows: 196,512 distinct corpus tokens "
            "(disjoint by construction; their fit is checked where the teacher's tokenizer is)") in out


def test_the_8b_dry_run_refuses_windows_its_corpora_cannot_hold(capsys, tmp_path, monkeypatch, byte_tokenizer):
    monkeypatch.chdir(ROOT)
    teacher = _teacher(tmp_path / "teacher", byte_tokenizer)
    code, _, err, _ = _plan(capsys, tmp_path, RECIPES / "llama3.1-8b-h100.toml", f"teacher={teacher}",
                            "data.calibration=code-train", "stages.prune.calib_windows=400", stage="prune")
    tokens = len(corpus_tokens(byte_tokenizer, "code-train"))
    held = tokens // 2047
    assert code == 2 and err.count("\n") == 1, err
    assert err == (f"error: stages[2].calib_windows=400 disjoint windows of stages[2].calib_seq_len=2048 do not fit: "
                   f"corpus code-train ({tokens} tokens) holds {held}, 400 asked; at most {held} fit\n")


def test_the_default_dry_run_counts_overlapping_windows_with_the_teachers_tokenizer(capsys, tmp_path, monkeypatch,
                                                                                    byte_tokenizer):
    monkeypatch.setenv("SMELT_CACHE", str(tmp_path / "cache"))  # the teacher written below stays in this test
    code, out, err, plan = _plan(capsys, tmp_path, RECIPES / "smollm2-cpu.toml", f"run_dir={tmp_path}/run")
    assert code == 0, err  # the teacher is not here: overlapping windows are not counted
    prune = next(s for s in plan["stages"] if s["name"] == "prune")
    assert prune["calibration"]["distinct_tokens"] is None and "--calib-sampling" not in prune["commands"][0]
    assert "overlapping windows: distinct tokens not counted (overlapping: counted where the teacher's tokenizer" in out
    from core.fetch import cache_root
    _teacher(cache_root() / "teachers" / "smollm2-135m", byte_tokenizer)
    code, out, err, plan = _plan(capsys, tmp_path, RECIPES / "smollm2-cpu.toml", f"run_dir={tmp_path}/run",
                                 "data.calibration=code-train")  # zh-train is not fetched here
    assert code == 0, err
    lengths = [("code-train", len(corpus_tokens(byte_tokenizer, "code-train")))]
    for name, windows, seq_len in (("prune", 64, 512), ("reconstruct", 128, 512), ("quantize", 32, 512)):
        c = next(s for s in plan["stages"] if s["name"] == name)["calibration"]
        starts = window_starts(lengths, windows, seq_len, 0, "overlapping")
        assert c["distinct_tokens"] == len(_positions(starts, seq_len)) <= windows * (seq_len - 1), name
        assert f"overlapping windows: {c['distinct_tokens']:,} distinct corpus tokens" in out
