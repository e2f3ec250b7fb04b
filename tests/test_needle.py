"""Needle in a haystack: prompts of exact length from evaluation text, the needle where asked, scoring by
the first number of the greedy continuation, a heatmap, and bad settings refused in one line."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import ROOT, tiny_config

from core.data import BUCKETS, corpus_tokens
from core.errors import SmeltError, run_cli
from core.needle import NeedleConfig, make_prompts
from eval import needle
from eval.needle import first_number, run_needle
from models.llama import build_model


def HAY(tok):
    return corpus_tokens(tok, BUCKETS["en"])


def test_prompts_have_the_length_the_needle_at_its_depth_and_come_from_eval_text(byte_tokenizer):
    cfg = NeedleConfig(lengths=(320,), depths=(0.0, 0.5, 1.0), samples=2)  # byte tokens: ~140 are the needle
    prompts = make_prompts(byte_tokenizer, cfg, "en", 320, HAY(byte_tokenizer))
    assert len(prompts) == 6 and all(len(p["ids"]) == 320 for p in prompts)
    hay = byte_tokenizer.decode(corpus_tokens(byte_tokenizer, BUCKETS["en"]).tolist())
    for p in prompts:
        text = byte_tokenizer.decode(p["ids"][1:])
        needle_text = f" The secret number of {p['name']} is {p['value']}. "
        at = text.index(needle_text)
        before, after = text[:at], text[at + len(needle_text):]
        question = f"\nQuestion: What is the secret number of {p['name']}?\nAnswer: The secret number of {p['name']} is"
        assert after.endswith(question)
        stack = before + after[:-len(question)]
        assert stack in hay  # one contiguous stretch of WikiText-2 test, cut where the needle went in
        share = len(before) / len(stack)
        assert abs(share - p["depth"]) < 0.02
        s, e = p["needle_span"]
        assert byte_tokenizer.decode(p["ids"][s:e]) == needle_text
    assert prompts == make_prompts(byte_tokenizer, cfg, "en", 320, HAY(byte_tokenizer))  # seeded
    assert {p["value"] for p in prompts} != {p["value"] for p in make_prompts(
        byte_tokenizer, NeedleConfig(lengths=(320,), depths=(0.0, 0.5, 1.0), samples=2, seed=1), "en", 320,
        HAY(byte_tokenizer))}


def test_scoring_counts_the_first_number_of_the_continuation(byte_tokenizer, monkeypatch):
    assert first_number(" 4821.\nThe") == "4821" and first_number(" is 12 or 4821") == "12"
    assert first_number(" unknown") is None
    model = build_model(tiny_config(max_seq_len=512), seed=0).eval()
    cfg = NeedleConfig(lengths=(200, 256), depths=(0.0, 1.0), samples=3, batch_size=4)

    def fake_sample(model, ids, max_new_tokens, temperature):  # answers right when the needle is first
        rows = []
        for row in ids.tolist():
            text = byte_tokenizer.decode(row)
            value = text.split("The secret number of ", 1)[1].split(" is ", 1)[1][:4]
            first = text.index("The secret number") < 10
            rows.append(row + byte_tokenizer(f" {value if first else '0000'}.", add_special_tokens=False)["input_ids"])
        return torch.tensor(rows)

    monkeypatch.setattr(needle, "sample", fake_sample)
    r = run_needle(model, byte_tokenizer, cfg, progress=False)["languages"]["en"]
    assert r["accuracy"] == 0.5 and r["by_length"] == {"200": 0.5, "256": 0.5}
    assert [(c["depth"], c["correct"]) for c in r["cells"]] == [(0.0, 3), (1.0, 0), (0.0, 3), (1.0, 0)]


def test_a_real_tiny_model_runs_end_to_end_and_draws(tmp_path, byte_tokenizer):
    model = build_model(tiny_config(max_seq_len=256), seed=0).eval()
    r = run_needle(model, byte_tokenizer, NeedleConfig(lengths=(200,), depths=(0.5,), samples=2), progress=False)
    assert r["languages"]["en"]["cells"][0]["total"] == 2 and len(r["languages"]["en"]["prompts"]) == 2
    needle.heatmap({"tiny": r, "again": r}, tmp_path / "n.png")
    assert (tmp_path / "n.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SmeltError, match="needle length 300 \\+ 8 new tokens exceeds the model's context"):
        run_needle(model, byte_tokenizer, NeedleConfig(lengths=(300,)), progress=False)
    # bf16: a bf16 copy answers (same prompts), the caller's fp32 model is left as it was
    before = {k: v.clone() for k, v in model.state_dict().items()}
    b = run_needle(model, byte_tokenizer, NeedleConfig(lengths=(200,), depths=(0.5,), samples=2, dtype="bfloat16"),
                   progress=False)
    assert b["settings"]["dtype"] == "bfloat16" and r["settings"]["dtype"] == "float32"
    assert [p["name"] for p in b["languages"]["en"]["prompts"]] == [p["name"] for p in r["languages"]["en"]["prompts"]]
    assert all(v.dtype == torch.float32 and torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("kw, message", [
    ({"lengths": (32,)}, "lengths=\\[32\\] must be integers >= 64"),
    ({"depths": (1.5,)}, "depths=\\[1.5\\] must be numbers in \\[0, 1\\]"),
    ({"samples": 0}, "samples=0 must be an integer >= 1"),
    ({"languages": ("fr",)}, "languages=\\['fr'\\]"),
    ({"dtype": "float16"}, "needle dtype='float16' is not float32 or bfloat16"),
])
def test_bad_settings_are_one_line(kw, message):
    with pytest.raises(SmeltError, match=message):
        NeedleConfig(**kw)


def test_cli_refuses_a_bad_grid_before_loading_anything(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "eval.needle", "--lengths", "64,abc", "--out", str(tmp_path / "x.json")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: --lengths '64,abc': expected comma-separated int values"]
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("argv, message", [
    (["--samples", "0"], "--samples 0: needle samples=0 must be an integer >= 1"),  # 0 is not "the default"
    (["--samples", "-2"], "--samples -2: needle samples=-2 must be an integer >= 1"),
    (["--lengths", "32,256"], "--lengths '32,256': needle lengths=[32, 256] must be integers >= 64"),
    (["--lengths", ""], "--lengths '': expected comma-separated int values"),
    (["--depths", "0,1.5"], "--depths '0,1.5': needle depths=[0.0, 1.5] must be numbers in [0, 1]"),
    (["--languages", ""], "--languages '': needle languages=['']: each one of en, zh"),
])
def test_cli_counts_lengths_and_lists_out_of_range_are_one_line_naming_the_flag(argv, message, tmp_path, capsys):
    out = tmp_path / "x.json"
    with pytest.raises(SystemExit) as e:
        run_cli(lambda: needle.main([*argv, "--out", str(out)]))
    assert e.value.code == 2 and capsys.readouterr().err.splitlines() == [f"error: {message}"]
    assert not out.exists()
