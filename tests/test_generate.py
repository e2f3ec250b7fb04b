"""KV-cached decoding gives the full forward's logits; sampling is seeded and honours its restrictions."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_config

from models.generate import next_token, sample
from models.llama import KVCache, build_model


@pytest.mark.parametrize("flavor", ["debug", "debug-untied"])
def test_cached_decoding_matches_the_full_forward(flavor):
    model = build_model(tiny_config(flavor), seed=3).eval()
    x = torch.randint(0, 260, (2, 24))
    full = model(x)
    cache = model.new_cache(2, 32)
    # a prefill chunk, single tokens, then a multi-token chunk at an offset (speculative verification)
    parts = [model(x[:, :9], cache), model(x[:, 9:10], cache), model(x[:, 10:11], cache), model(x[:, 11:], cache)]
    assert torch.allclose(torch.cat(parts, 1), full, atol=1e-5)
    # rolling back rejected positions and re-feeding them gives the same logits again
    for c in cache.values():
        c.truncate(16)
    assert torch.allclose(model(x[:, 16:], cache), full[:, 16:], atol=1e-5)


@pytest.mark.parametrize("new, start", [(6, 0), (1, 6), (3, 6)])  # prefill, one-token step, verification
def test_the_cache_reads_grouped_kv_heads_in_place_with_the_repeated_heads_results(new, start):
    # 9 query heads on 3 KV heads (SmolLM2's grouping): the same numbers as repeating each KV head per query head,
    # bit for bit, so in-place reads change no decoded token and no measured result
    g = torch.Generator().manual_seed(0)
    cache = KVCache(2, 3, 16, start + new)
    if start:
        cache.attend(*(torch.randn(2, h, start, 16, generator=g) for h in (9, 3, 3)))
    q, k, v = (torch.randn(2, h, new, 16, generator=g) for h in (9, 3, 3))
    out = cache.attend(q, k, v)
    keys, values = (t[:, :, :start + new].repeat_interleave(3, dim=1) for t in (cache.k, cache.v))
    if start == 0:  # the prefill's fused causal kernel
        ref = F.scaled_dot_product_attention(q, keys, values, is_causal=True)
    else:
        mask = torch.ones(new, start + new, dtype=torch.bool).tril(diagonal=start)
        ref = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask if new > 1 else None)
    assert torch.equal(out, ref)


def test_cache_overflow_and_bad_truncation_are_refused():
    model = build_model(tiny_config(), seed=0).eval()
    cache = model.new_cache(1, 4)
    with pytest.raises(ValueError, match="overflow"):
        model(torch.zeros(1, 5, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="truncate"):
        cache["0"].truncate(3)


def test_sampling_is_seeded_greedy_matches_argmax_and_first_token_is_restricted():
    model = build_model(tiny_config(), seed=1).eval()
    prompt = torch.full((4, 1), 1)
    a = sample(model, prompt, 12, generator=torch.Generator().manual_seed(0))
    b = sample(model, prompt, 12, generator=torch.Generator().manual_seed(0))
    assert a.shape == (4, 13) and torch.equal(a, b) and torch.equal(a[:, :1], prompt)
    greedy = sample(model, prompt, 6, temperature=0)
    step = prompt
    for _ in range(6):
        step = torch.cat([step, model(step)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(greedy, step)
    allowed = torch.zeros(260, dtype=torch.bool)
    allowed[[100, 101]] = True
    c = sample(model, prompt, 3, first_allowed=allowed, generator=torch.Generator().manual_seed(1))
    assert set(c[:, 1].tolist()) <= {100, 101}


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.05, 0.05]]))
    g = torch.Generator().manual_seed(0)
    picks = {int(next_token(logits, top_p=0.8, generator=g)) for _ in range(200)}
    assert picks == {0, 1}
    assert int(next_token(logits, top_p=0.5, generator=g)) == 0


def test_bad_sampling_arguments_are_named_and_train_mode_is_restored():
    model = build_model(tiny_config(max_seq_len=16), seed=0).train()
    prompt = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="max_new_tokens=13"):
        sample(model, prompt, 13)
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        sample(model, prompt, 0)
    with pytest.raises(ValueError, match="temperature=-1"):
        sample(model, prompt, 2, temperature=-1)
    with pytest.raises(ValueError, match="empty"):
        sample(model, prompt, 2, first_allowed=torch.zeros(260, dtype=torch.bool))
    assert model.training


@pytest.mark.parametrize("window", [None, 4])
def test_the_static_cache_decodes_as_the_dynamic_one_with_device_positions(window):
    """StaticKVCache (a CUDA-graph-safe decode step: positions on the device, the whole buffer read under a
    mask) gives the dynamic cache's logits for a prefill, single tokens after it, a rollback and a chunk."""
    model = build_model(tiny_config(sliding_window=window), seed=3).eval()
    tokens = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(1))
    dyn, sta = model.new_cache(2, 16), model.new_cache(2, 16, static=True)
    assert all(c.static and c.pos.ndim == 0 for c in sta.values())
    with torch.no_grad():
        steps = [tokens[:, :5], tokens[:, 5:6], tokens[:, 6:7], tokens[:, 7:8]]
        for chunk in steps:
            torch.testing.assert_close(model(chunk, sta), model(chunk, dyn), rtol=1e-5, atol=1e-5)
        for cache in (*dyn.values(), *sta.values()):
            cache.truncate(6)  # two drafted tokens rejected
        torch.testing.assert_close(model(tokens[:, 6:10], sta), model(tokens[:, 6:10], dyn), rtol=1e-5, atol=1e-5)
        assert int(next(iter(sta.values())).pos) == next(iter(dyn.values())).pos == 10
