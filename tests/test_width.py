"""Width pruning: the GQA-aware plan (pure), a smaller model that computes exactly what the original does
with the removed heads and channels silenced, protected heads kept, and a CLI whose output loads in
transformers."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_config

from core.errors import SmeltError, run_cli
from models.hf_io import load_hf
from models.llama import build_model
from prune.width import check_shape, main, plan_layer, shrink

TOKENS = torch.tensor([[1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]])


def test_plan_keeps_whole_kv_groups_and_protected_heads_first():
    imp = torch.tensor([5.0, 4.0, 0.1, 0.2, 0.3, 0.4, 3.0, 0.5, 0.6])  # 9 heads, 3 KV groups of 3
    chan = torch.tensor([0.5, 2.0, 0.1, 3.0])
    p = plan_layer(imp, chan, set(), 9, 3, 4, 2, 2)  # keep 2 groups x 2 heads, 2 channels
    assert p == {"heads": [0, 1, 6, 8], "groups": [0, 2], "channels": [1, 3]}
    p = plan_layer(imp, chan, {3}, 9, 3, 4, 2, 2)  # head 3 protected: group 1 is kept, with head 3 in it
    assert p["groups"] == [0, 1] and p["heads"] == [0, 1, 3, 5]
    with pytest.raises(SmeltError, match="--n-kv-heads 1: layer 0 has protected heads in 2 KV groups"):
        plan_layer(imp, chan, {2, 3}, 9, 3, 3, 1, 2)
    with pytest.raises(SmeltError, match="--n-heads 2: layer 0 KV group 1 holds 2 protected heads"):
        plan_layer(imp, chan, {3, 4}, 9, 3, 2, 2, 2)


@pytest.mark.parametrize("n_heads,n_kv,ffn,message", [
    (3, 2, 64, "--n-heads 3: with 2 KV heads it must be a multiple of 2"),
    (8, 2, 64, "at most 4"), (2, 3, 64, "--n-kv-heads 3: the model has 2 KV heads"),
    (2, 1, 129, "--ffn 129: the model has 128 MLP channels")])
def test_shapes_that_break_gqa_or_grow_the_model_are_refused(n_heads, n_kv, ffn, message):
    with pytest.raises(SmeltError, match=message):
        check_shape(n_heads, n_kv, ffn, tiny_config())


def _silenced(model, plan):
    """The original model with every removed head's wo columns and removed channel's w2 columns zeroed."""
    hd = model.cfg.head_dim
    with torch.no_grad():
        for layer, p in zip(model.layers.values(), plan):
            for h in set(range(model.cfg.n_heads)) - set(p["heads"]):
                layer.attention.wo.weight[:, h * hd:(h + 1) * hd] = 0
            drop = sorted(set(range(model.cfg.ffn_hidden)) - set(p["channels"]))
            layer.feed_forward.w2.weight[:, drop] = 0
    return model


def test_smaller_model_equals_the_original_with_removed_units_silenced():
    model = build_model(tiny_config(max_seq_len=64), seed=2).eval()  # 4 heads / 2 KV, ffn 128
    g = torch.Generator().manual_seed(0)
    plan = [plan_layer(torch.rand(4, generator=g), torch.rand(128, generator=g), {1} if i == 0 else set(),
                       4, 2, 2, 1, 96, str(i)) for i in range(2)]
    assert 1 in plan[0]["heads"] and plan[0]["groups"] == [0]
    small = shrink(model, plan, 2, 1, 96).eval()
    assert (small.cfg.n_heads, small.cfg.n_kv_heads, small.cfg.ffn_hidden, small.cfg.head_dim) == (2, 1, 96, 16)
    with torch.no_grad():
        torch.testing.assert_close(small(TOKENS), _silenced(model, plan)(TOKENS), rtol=1e-5, atol=1e-5)


def test_cli_writes_a_model_transformers_loads_and_renumbers_the_protected_set(tmp_path, tiny_model_dir, capsys):
    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(1)
    heads = tmp_path / "heads.json"
    heads.write_text(json.dumps({
        "protected": [{"layer": "1", "head": 3, "why": ["retrieval"]}],
        "head_importance": torch.rand(2, 4, generator=g).tolist(),
        "channel_importance": torch.rand(2, 128, generator=g).tolist()}))
    out = tmp_path / "narrow"
    run_cli(lambda: main(["--teacher", str(tiny_model_dir), "--heads", str(heads), "--n-heads", "2",
                          "--n-kv-heads", "1", "--ffn", "64", "--out", str(out)]))
    ours = load_hf(out).eval()
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["intermediate_size"], cfg["head_dim"]) == (
        2, 1, 64, 16)
    with torch.no_grad():
        torch.testing.assert_close(hf(TOKENS).logits, ours(TOKENS), rtol=1e-4, atol=1e-4)
    man = json.loads((out / "manifest.json").read_text())
    kept = man["metrics"]["kept"][1]
    assert kept["kv_groups"] == [1] and 3 in kept["heads"]  # the protected head's group survives
    assert json.loads((out / "protected.json").read_text())["protected"] == [
        {"layer": "1", "head": kept["heads"].index(3)}]
    assert man["metrics"]["params_after"] < man["metrics"]["params_before"]
    heads.write_text(json.dumps({"protected": [], "head_importance": [[1.0] * 4],
                                 "channel_importance": [[1.0] * 128]}))  # scored on a 1-layer model
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        run_cli(lambda: main(["--teacher", str(tiny_model_dir), "--heads", str(heads), "--n-heads", "2",
                              "--n-kv-heads", "1", "--ffn", "64", "--out", str(tmp_path / "bad")]))
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and "--heads" in err and "score this model" in err and "\n" not in err
    assert not (tmp_path / "bad").exists()
