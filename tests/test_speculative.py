"""Self-speculative decoding with MTP modules: greedy output is exactly plain greedy decoding, sampled
output has exactly the main model's distribution, acceptance is counted right, bad settings are refused."""
from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn

from core.errors import SmeltError
from models.generate import PATHS, SMALL_M, WIDE_OUT, pick_path, sample, small_m_linears, tune_small_m
from models.llama import LlamaConfig, build_model
from models.mtp import MTPHeads
from models.speculative import DraftVocab, alpha_standard_error, frequent_token_ids, speculative_generate

CFG = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_hidden=64, max_seq_len=128,
                  tie_embeddings=False)
PROMPT = torch.tensor([[3, 17, 42, 5, 9, 33]])


def _peaked(cfg: LlamaConfig, seed: int, block_scale: float):
    """A model whose next token depends mostly on the current token (a bigram table), and on the context
    through blocks scaled by block_scale: peaked logits, so greedy has no near-ties."""
    model = build_model(cfg, seed=seed).eval()
    with torch.no_grad():
        model.output.weight.mul_(50)  # untied: the bigram table output(norm(emb(x))) is a random map
        for layer in model.layers.values():
            layer.attention.wo.weight.mul_(block_scale * 10)
            layer.feed_forward.w2.weight.mul_(block_scale * 10)
    return model


def _oracle(cfg: LlamaConfig, depth: int) -> MTPHeads:
    """MTP modules that read only the token embedding (proj = [0 | I], blocks silenced): each drafts the
    bigram prediction of its token, which a block_scale=0 main model follows exactly."""
    heads = MTPHeads(cfg, depth)
    heads.init_weights(seed=0)
    with torch.no_grad():
        for m in heads.mtp:
            m.proj.weight.zero_()
            m.proj.weight[:, cfg.dim:] = torch.eye(cfg.dim)
            m.block.attention.wo.weight.zero_()
            m.block.feed_forward.w2.weight.zero_()
    return heads


@pytest.mark.parametrize("block_scale,gamma", [(0.0, 1), (0.0, 2), (0.1, 1), (0.1, 2), (1.0, 2)])
def test_greedy_is_token_for_token_plain_greedy(block_scale, gamma):
    model = _peaked(CFG, 1, block_scale)
    heads = _oracle(CFG, 2)
    want = sample(model, PROMPT, 40, temperature=0)
    got, stats = speculative_generate(model, heads, PROMPT, 40, gamma=gamma, temperature=0)
    assert torch.equal(got, want)
    s = stats.summary(gamma)
    if block_scale == 0:  # the oracle drafts exactly what the bigram model says: every draft accepted
        assert s["alpha_first"] == 1 and s["tokens_per_forward"] == gamma + 1
    elif block_scale < 1:  # the context moves the main model away from the bigram drafts now and then
        assert 0 in stats.accepted and gamma in stats.accepted  # full, partial and no acceptance all ran
        assert 0 < s["mean_accepted"] < gamma
    random_heads = MTPHeads(CFG, 2)
    random_heads.init_weights(seed=5)
    got, _ = speculative_generate(model, random_heads, PROMPT, 40, gamma=gamma, temperature=0)
    assert torch.equal(got, want)


@pytest.mark.parametrize("path", [None, *PATHS])
def test_small_m_linears_compute_the_same_products_and_restore_every_layer(path):
    """Every form of product (and the plan tuned on this machine) gives F.linear's result."""
    model = _peaked(CFG, 1, 0.1)
    lin = model.layers["0"].feed_forward.w1
    biased, bf16, wide = nn.Linear(CFG.dim, 8), nn.Linear(CFG.dim, 8).bfloat16(), nn.Linear(CFG.dim, WIDE_OUT)
    x = {m: torch.randn(1, m, CFG.dim) for m in (1, 2, SMALL_M, SMALL_M + 1)}
    want = {m: (lin(v), biased(v), wide(v)) for m, v in x.items()}
    fp32_linears = sum(type(m) is nn.Linear for m in model.modules())
    shapes = {tuple(m.weight.shape) for m in (*model.modules(), biased, wide) if type(m) is nn.Linear}
    plan = None if path is None else {(*s, r): path for s in shapes for r in range(1, SMALL_M + 1)
                                      if path != "mv_t2" or (r == 1 and s[0] >= WIDE_OUT)}
    with small_m_linears(model, model.layers["0"], biased, bf16, wide, plan=plan) as sm:  # layers["0"] again: once
        assert sm.layers == fp32_linears + 2  # bf16 keeps its own path
        assert set(sm.plan.values()) <= set(PATHS) and (path is not None or len(sm.plan) == len(shapes) * SMALL_M)
        assert sm.plan.get((WIDE_OUT, CFG.dim, 2)) != "mv_t2"  # one row as two: only at one row
        assert "forward" in lin.__dict__ and "forward" not in bf16.__dict__
        for m, v in x.items():
            assert torch.allclose(lin(v), want[m][0], rtol=1e-5, atol=1e-6)
            assert torch.allclose(biased(v), want[m][1], rtol=1e-5, atol=1e-6)
            assert torch.allclose(wide(v), want[m][2], rtol=1e-5, atol=1e-6)
    assert not any("forward" in m.__dict__ for m in [*model.modules(), biased])
    with pytest.raises(ValueError, match="is not one of"), small_m_linears(biased, plan={(8, CFG.dim, 2): "mv_t2"}):
        pass
    if path is None:  # tuned: every shape, every row count, in the JSON form eval.speculative writes
        assert {k: len(v) for k, v in sm.record().items()} == {f"{o}x{i}": SMALL_M for o, i in shapes}


def test_tuning_keeps_f_linear_on_near_ties_and_leaves_the_global_rng_alone():
    assert pick_path({"linear": 1.0, "mv_t": 0.97}) == "linear"  # inside the margin: timing noise
    assert pick_path({"linear": 1.0, "mv_t": 0.90}) == "mv_t"
    assert pick_path({"linear": 1.0, "mv_t": 0.99, "mv_t2": 0.5}) == "mv_t2"
    assert pick_path({"linear": 0.5, "mv_t": 0.9}) == "linear"
    torch.manual_seed(3)
    want = torch.rand(4)
    torch.manual_seed(3)
    tune_small_m([torch.ones(8, CFG.dim)], repeats=3)  # its inputs come from its own generator
    assert torch.equal(torch.rand(4), want)


@pytest.mark.parametrize("gamma", [1, 2])
def test_greedy_with_small_m_linears_is_still_plain_greedy(gamma):
    model = _peaked(CFG, 1, 1.0)
    heads = MTPHeads(CFG, 2)
    heads.init_weights(seed=5, trunk=model)
    want = sample(model, PROMPT, 40, temperature=0)
    with small_m_linears(model, heads):
        plain = sample(model, PROMPT, 40, temperature=0)
        got, stats = speculative_generate(model, heads, PROMPT, 40, gamma=gamma, temperature=0)
    assert torch.equal(plain, want) and torch.equal(got, want) and stats.rounds > 0


@pytest.mark.parametrize("depth", [1, 2])
def test_cached_drafts_are_the_teacher_forced_modules_predictions(depth):
    """Every draft equals the argmax of the modules run teacher-forced over the final sequence: each level's
    cache and hidden states, rolled back after rejected drafts, hold exactly what a full forward computes,
    so acceptance measures the modules as they were trained. Depth 2: level 1 is the bigram oracle (often
    accepted, sometimes not) and level 2 a random module with strong blocks, so level 2's context holds
    states computed from rejected drafts unless the rollback drops them."""
    model = _peaked(CFG, 1, 0.3)
    heads = _oracle(CFG, depth)
    strong = MTPHeads(CFG, depth)
    strong.init_weights(seed=3)
    with torch.no_grad():
        m = heads.mtp[depth - 1]
        m.load_state_dict(strong.mtp[depth - 1].state_dict())
        m.block.attention.wo.weight.mul_(20)
        m.block.feed_forward.w2.weight.mul_(20)
    out, stats = speculative_generate(model, heads, PROMPT, 80, gamma=depth)
    seq = out[0].tolist()
    with torch.no_grad():
        forced = heads(model, model.hidden_states(out), out)  # forced[k-1][0, i]: module k at position i
    n, checked = PROMPT.shape[1], [0] * depth  # n: tokens in the main cache when the round starts
    for drafts, a in zip(stats.drafted, stats.accepted, strict=True):
        for k, d in enumerate(drafts, start=1):
            if k > 1 and (n + k > len(seq) - 1 or drafts[k - 2] != seq[n + k - 1]):
                break  # module k read draft k-1, which was rejected (or cut off): the sequence lacks it
            assert d == int(forced[k - 1][0, n - 1].argmax()), (n, k)
            checked[k - 1] += 1
        n += 1 + a
    assert checked[0] == stats.rounds and min(checked) >= 10
    assert 0 in stats.accepted and sum(stats.accepted) > 0  # rejections to roll back, acceptances to check


def test_a_restricted_draft_vocabulary_keeps_greedy_exact_and_drafts_only_from_it():
    """Drafts come from the subset only; where the main model's choice lies outside it the draft is rejected,
    and the output is still plain greedy token for token (with and without small-M linears)."""
    model = _peaked(CFG, 1, 0.0)
    heads = _oracle(CFG, 2)  # drafts exactly the main model's choice from the whole head
    want = sample(model, PROMPT, 40, temperature=0)
    _, full = speculative_generate(model, heads, PROMPT, 40, gamma=2)
    chosen = want[0, PROMPT.shape[1]:]
    n_chosen = len(set(chosen.tolist()))
    assert n_chosen >= 2
    subset = frequent_token_ids(chosen, n_chosen // 2, CFG.vocab_size)  # misses some of the choices
    vocab = DraftVocab(model.output, subset)
    for roots in ((), (model, heads, vocab)):
        with small_m_linears(*roots):
            got, stats = speculative_generate(model, heads, PROMPT, 40, gamma=2, draft_vocab=vocab)
        assert torch.equal(got, want)
        assert {d for ds in stats.drafted for d in ds} <= set(subset.tolist())
        assert full.summary(2)["alpha_first"] == 1 > stats.summary(2)["alpha_first"] > 0


def test_frequent_token_ids_and_draft_vocabulary_errors():
    assert frequent_token_ids(torch.tensor([5, 2, 5, 7, 2, 5]), 4, 8).tolist() == [5, 2, 7, 0]  # ties: lower id
    model = build_model(CFG, seed=0)
    vocab = DraftVocab(model.output, torch.tensor([3, 1]))
    x = torch.randn(2, CFG.dim)
    assert torch.allclose(vocab(x), model.output(x)[:, [3, 1]], atol=1e-6)  # a smaller gemm: another sum order
    for bad, message in ((lambda: frequent_token_ids(torch.tensor([1]), 0, 8), "size 0 must be within"),
                         (lambda: frequent_token_ids(torch.tensor([9]), 2, 8), "ids outside"),
                         (lambda: DraftVocab(model.output, torch.tensor([1, 1])), "distinct"),
                         (lambda: DraftVocab(model.output, torch.tensor([64])), "within \\[0, 64\\)"),
                         (lambda: speculative_generate(model, MTPHeads(CFG, 1), PROMPT, 4, draft_vocab=DraftVocab(
                             nn.Linear(CFG.dim, 10), torch.tensor([1]))), "built for 10 tokens")):
        with pytest.raises(SmeltError, match=message):
            bad()


def _exact_marginals(model, prompt, n_new: int) -> list[torch.Tensor]:
    """Exact distribution of each of the first n_new sampled tokens (temperature 1), by enumeration."""
    V = model.cfg.vocab_size
    seqs = torch.tensor(list(itertools.product(range(V), repeat=n_new)))
    ids = torch.cat([prompt.expand(len(seqs), -1), seqs], 1)
    logp = model(ids).float().log_softmax(-1)[:, prompt.shape[1] - 1:-1]  # [S, n_new, V]
    joint = logp.gather(-1, seqs[..., None]).squeeze(-1).sum(-1).exp()
    return [torch.zeros(V).index_add_(0, seqs[:, j], joint) for j in range(n_new)]


@pytest.mark.parametrize("draft_ids", [None, (2, 5, 0)])
def test_sampling_has_the_main_models_distribution(draft_ids):
    """Tokens 2 and 3 are the ones MTP drafts propose: their marginals over 3000 runs must match the exact
    marginals (total variation <= 0.05; the expected TV of 3000 samples over 8 tokens is ~0.02), while the
    drafter's own proposals are far from them (so a sampler that accepted every draft would fail). With a
    3-token draft vocabulary q is zero on the other 5, which only the residual can reach."""
    cfg = LlamaConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=8, ffn_hidden=64, max_seq_len=32)
    model = build_model(cfg, seed=3).eval()
    with torch.no_grad():
        model.tok_embeddings.weight.mul_(8)
    heads = MTPHeads(cfg, 2)
    heads.init_weights(seed=4, std=0.3)
    prompt = torch.tensor([[1, 4, 6]])
    exact = _exact_marginals(model, prompt, 3)
    vocab = None if draft_ids is None else DraftVocab(model.output, torch.tensor(draft_ids))
    g = torch.Generator().manual_seed(0)
    n, counts, accepted = 3000, torch.zeros(3, 8), 0
    for _ in range(n):
        out, stats = speculative_generate(model, heads, prompt, 3, gamma=2, temperature=1.0, generator=g,
                                          draft_vocab=vocab)
        if vocab is not None:
            assert {d for ds in stats.drafted for d in ds} <= set(draft_ids)
        counts[torch.arange(3), out[0, 3:]] += 1
        accepted += sum(stats.accepted)
    for j in (1, 2):
        tv = 0.5 * (counts[j] / n - exact[j]).abs().sum()
        assert tv < 0.05, (j, tv)
    assert 0 < accepted < 2 * n  # some drafts accepted, some rejected: both paths ran
    # power: the drafter's distribution for token 2 (module 1 after the main model's token 1)
    h0 = model.hidden_states(prompt)
    q2 = torch.zeros(8)
    for t1 in range(8):
        ids = torch.cat([prompt, torch.tensor([[t1]])], 1)
        h = model.hidden_states(ids)
        logits = heads(model, h, torch.cat([ids, torch.zeros(1, 1, dtype=torch.long)], 1))[0][0, -1]
        q2 += exact[0][t1] * logits.softmax(-1)
    assert 0.5 * (q2 - exact[1]).abs().sum() > 0.1 and h0.shape[1] == 3


def test_bad_settings_are_one_line_errors():
    model, heads = build_model(CFG, seed=0).eval(), MTPHeads(CFG, 1)
    with pytest.raises(SmeltError, match="gamma=0 must be >= 1"):
        speculative_generate(model, heads, PROMPT, 4, gamma=0)
    with pytest.raises(SmeltError, match="gamma=2 exceeds the MTP depth 1"):
        speculative_generate(model, heads, PROMPT, 4, gamma=2)
    with pytest.raises(SmeltError, match="exceeds the model's max_seq_len"):
        speculative_generate(model, heads, PROMPT, 200, gamma=1)
    with pytest.raises(SmeltError, match="depth=0 must be >= 1"):
        MTPHeads(CFG, 0)
    from models.mtp import MTPConfig

    with pytest.raises(SmeltError, match="mtp.target='self' is not one of teacher, main"):
        MTPConfig(depth=1, target="self")
    with pytest.raises(SmeltError, match="mtp.target='main' needs a frozen main model"):
        MTPConfig(depth=1, target="main", joint=True)
    with pytest.raises(SmeltError, match="mtp.feature_weight=-1.0 must be >= 0"):
        MTPConfig(depth=1, feature_weight=-1.0)


def test_benchmark_cli_reports_acceptance_and_speed_and_refuses_a_foreign_mtp_file(tmp_path, capsys):
    import json

    from conftest import make_byte_tokenizer, tiny_config

    from core.errors import run_cli
    from eval.speculative import main
    from models.hf_io import save_hf
    from models.mtp import main_fingerprint, save_mtp

    cfg = tiny_config(max_seq_len=256)
    model = build_model(cfg, seed=1)
    out = tmp_path / "art"
    out.mkdir()
    save_hf(model, out, tokenizer=make_byte_tokenizer())
    heads = MTPHeads(cfg, 1)
    heads.init_weights(seed=0, trunk=model)
    save_mtp(dict(heads.named_parameters()), cfg, out, main_fingerprint(out))
    report = tmp_path / "spec.json"
    run_cli(lambda: main(["--model", str(out), "--prompts", "2", "--prompt-len", "16", "--new-tokens", "12",
                          "--out", str(report)]))
    r = json.loads(report.read_text())
    assert set(r["buckets"]) == {"en", "zh", "code"} and r["overall"]["rounds"] > 0
    o = r["overall"]
    assert 0 <= o["alpha_first"] <= 1 and 1 <= o["tokens_per_forward"] <= 2 and o["plain_tok_s"] > 0
    assert r["ceiling_speedup"] > 0 and r["mtp"]["depth"] == "1" and r["settings"]["small_m"] is True
    assert r["settings"]["small_m_plan"]["260x64"]["1"] in ("linear", "mv_t")  # the tiny head, tuned here
    assert r["settings"]["draft_vocab"] is None
    per_prompt = [a for b in ("en", "zh", "code") for a in r["buckets"][b]["alpha_first_per_prompt"]]
    assert len(per_prompt) == 6 == len(o["alpha_first_per_prompt"]) and o["alpha_first_se"] is not None
    assert min(per_prompt) <= o["alpha_first"] <= max(per_prompt)
    run_cli(lambda: main(["--model", str(out), "--prompts", "1", "--prompt-len", "16", "--new-tokens", "8",
                          "--languages", "en", "--draft-vocab", "40", "--out", str(report)]))
    rec = json.loads(report.read_text())["settings"]["draft_vocab"]
    assert rec["size"] == 40 and 0.5 < rec["corpus_coverage"] < 1  # byte tokens: 40 frequent ones, not all
    capsys.readouterr()
    for argv, message in ((["--gamma", "2"], "--gamma 2 exceeds the MTP depth 1"),
                          (["--gamma", "0"], "--gamma 0 must be >= 1"),
                          (["--draft-vocab", "100000"], "--draft-vocab 100000 must be within [0, ")):
        with pytest.raises(SystemExit):
            run_cli(lambda argv=argv: main(["--model", str(out), *argv]))
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err
    save_hf(build_model(cfg, seed=2), out)  # the main model changed under the MTP file
    with pytest.raises(SystemExit):
        run_cli(lambda: main(["--model", str(out)]))
    assert "trained against another main model" in capsys.readouterr().err


def test_alpha_standard_error_is_clustered_by_prompt():
    # two prompts, 10 rounds each: one accepts every first draft, one none. alpha 0.5; the i.i.d. error would
    # be sqrt(0.25 / 20) = 0.112, the clustered one sqrt(2 * (5^2 + 5^2)) / 20 = 0.5: two prompts are two samples
    assert alpha_standard_error([[1] * 10, [0] * 10]) == pytest.approx(0.5)
    assert alpha_standard_error([[1, 0] * 5, [0, 2] * 5]) == 0  # every prompt at alpha 0.5: no spread between them
    assert alpha_standard_error([[1, 0, 1]]) is None and alpha_standard_error([[1], []]) is None
    # unequal lengths: a_i = (3, 0), r_i = (4, 2), alpha = 0.5; residuals 1 and -1
    assert alpha_standard_error([[1, 1, 1, 0], [0, 0]]) == pytest.approx(math.sqrt(2 * 2) / 6)


def test_an_mtp_file_for_another_shape_or_depth_is_refused(tmp_path):
    from dataclasses import replace

    from models.mtp import load_mtp_into, save_mtp

    heads = MTPHeads(CFG, 1)
    heads.init_weights(seed=0)
    save_mtp(dict(heads.named_parameters()), CFG, tmp_path, "f" * 64)
    load_mtp_into(MTPHeads(CFG, 1), tmp_path)  # the same shape loads
    with pytest.raises(SmeltError, match="built for ffn_hidden=64, the main model has 96"):
        load_mtp_into(MTPHeads(replace(CFG, ffn_hidden=96), 1), tmp_path)
    with pytest.raises(SmeltError, match="MTP depth 2 requested, the file holds 1"):
        load_mtp_into(MTPHeads(CFG, 2), tmp_path)
    (tmp_path / "mtp.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(SmeltError):
        load_mtp_into(MTPHeads(CFG, 1), tmp_path)


def test_self_text_is_the_models_own_greedy_continuation_of_training_prompts(tiny_model_dir, tmp_path, capsys):
    """distill.self_text: each row is its prompt (a training window) plus what the model writes greedily from
    it, cut at EOS; the file is a training source the trainer reads; bad settings write nothing."""
    import json

    from core.data import calibration_windows
    from core.errors import run_cli
    from core.text_source import TextSourceConfig
    from distill.self_text import main
    from models.hf_io import load_hf, load_tokenizer

    out = tmp_path / "self"
    main(["--model", str(tiny_model_dir), "--corpus", "wikitext2-valid+code-train", "--prompts", "6",
          "--prompt-len", "12", "--new-tokens", "20", "--batch-size", "4", "--out", str(out)])
    rows = [json.loads(line)["text"] for line in (out / "text.jsonl").read_text().splitlines()]
    manifest = json.loads((out / "manifest.json").read_text())
    assert len(rows) == 6 and manifest["stage"] == "self_text" and manifest["metrics"]["generated_tokens"] == 120
    tok, model = load_tokenizer(tiny_model_dir), load_hf(tiny_model_dir).eval()
    prompts = calibration_windows(tok, 6, 12, 0, "wikitext2-valid+code-train")
    want = sample(model, prompts, 20, temperature=0)
    for text, row in zip(rows, want.tolist(), strict=True):
        new = row[12:]
        new = new[:new.index(tok.eos_token_id)] if tok.eos_token_id in new else new
        assert text == tok.decode(row[:12] + new, skip_special_tokens=True)
    assert TextSourceConfig(source=str(out / "text.jsonl")).resolve()[0] == "json"
    # the output folder as a source is its text (not its manifest.json)
    assert TextSourceConfig(source=str(out)).resolve() == ("json", [out / "text.jsonl"])
    for bad, msg in ((["--prompt-len", "1"], "--prompt-len=1 must be >= 2"),
                     (["--new-tokens", "600"], "exceeds the model's max_seq_len=512"),
                     (["--corpus", "wikitext2-test"], "evaluation text must never be"),
                     (["--corpus", "wikitext2-valid+code-train", "--prompts", "1"], "--prompts=1 is fewer than the 2"),
                     (["--temperature", "-1"], "--temperature=-1.0 must be >= 0")):
        with pytest.raises(SystemExit):
            run_cli(lambda b=bad: main(["--model", str(tiny_model_dir), "--out", str(tmp_path / "bad"), *b]))
        assert msg in capsys.readouterr().err and not (tmp_path / "bad").exists()
