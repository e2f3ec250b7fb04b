"""MTP modules that also read earlier main-model blocks (mtp.fuse_layers, EAGLE-3's fused features): a fused
module starts exactly as the plain one, reads the named blocks' residual stream, drafts exactly under
speculative decoding, and its file refuses modules built for other blocks."""
from __future__ import annotations

import pytest
import torch
from test_speculative import _peaked

from core.errors import SmeltError
from models.generate import sample
from models.llama import LlamaConfig, build_model
from models.mtp import MTPConfig, MTPHeads, load_mtp, load_mtp_into, main_fingerprint, mtp_metadata, save_mtp
from models.speculative import speculative_generate

CFG = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_hidden=64, max_seq_len=128,
                  tie_embeddings=False)
TOKENS = torch.tensor([[3, 17, 42, 5, 9, 33, 8, 1, 60, 22, 14, 7]])


def _model():
    model = build_model(CFG, seed=1).eval()
    with torch.no_grad():
        model.output.weight.mul_(20)  # peaked logits: greedy has no near-ties
    return model


def test_a_fused_module_starts_as_the_plain_one_and_reads_the_named_blocks():
    model = _model()
    fused = MTPHeads(CFG, 1, (0,))
    fused.init_weights(seed=0, trunk=model)
    proj = fused.mtp[0].proj.weight
    assert proj.shape == (CFG.dim, 3 * CFG.dim) and not proj[:, 2 * CFG.dim:].any()
    plain = MTPHeads(CFG, 1)
    plain.init_weights(seed=0, trunk=model)  # the same seed: the same start, weight for weight
    shared = {k: v[:, :2 * CFG.dim] if k.endswith("proj.weight") else v
              for k, v in fused.state_dict().items() if ".fnorms." not in k}
    assert shared.keys() == plain.state_dict().keys()
    assert all(torch.equal(v, plain.state_dict()[k]) for k, v in shared.items())
    with torch.no_grad():
        h0, x0 = fused.level0(model, TOKENS)
        after0 = model.layers["0"](model.tok_embeddings(TOKENS), model.rope_cos[:12], model.rope_sin[:12])
        assert torch.equal(x0[..., :CFG.dim], h0) and torch.equal(h0, model.hidden_states(TOKENS))
        assert torch.allclose(x0[..., CFG.dim:], after0)  # the residual stream after block 0
        start = fused(model, x0, TOKENS)[0]
        assert torch.allclose(start, plain(model, h0, TOKENS)[0], atol=1e-5)  # zero columns: the plain module
        proj[:, 2 * CFG.dim:].normal_(std=0.3)
        assert not torch.allclose(fused(model, x0, TOKENS)[0], start, atol=1e-3)  # now block 0 counts
        with pytest.raises(SmeltError, match="input of width 32, expected 64"):
            fused(model, h0, TOKENS)  # a level 0 without its fused block


@pytest.mark.parametrize("gamma", [1, 2])
def test_greedy_with_fused_modules_is_plain_greedy_and_drafts_are_teacher_forced(gamma):
    """Level 0 holds [h^0; the fused blocks' states] per position through the rounds and rollbacks: every
    first draft equals module 1's argmax run teacher-forced over the final sequence. The modules draft the
    bigram prediction of their token (blocks silenced) nudged by the fused blocks' states, and the main model
    mostly follows bigrams, so drafts are accepted and rejected both."""
    model = _peaked(CFG, 1, 0.3)
    heads = MTPHeads(CFG, 2, (1, 0))
    heads.init_weights(seed=3)
    d = CFG.dim
    with torch.no_grad():
        for m in heads.mtp:
            m.proj.weight.zero_()
            m.proj.weight[:, d:2 * d] = torch.eye(d)
            m.block.attention.wo.weight.zero_()
            m.block.feed_forward.w2.weight.zero_()
        heads.mtp[0].proj.weight[:, 2 * d:].normal_(std=0.1, generator=torch.Generator().manual_seed(0))
    prompt = TOKENS[:, :6]
    got, stats = speculative_generate(model, heads, prompt, 60, gamma=gamma)
    assert torch.equal(got, sample(model, prompt, 60, temperature=0))
    with torch.no_grad():
        forced = heads(model, heads.level0(model, got)[1], got)[0][0].argmax(-1)
    n = prompt.shape[1]
    for drafts, a in zip(stats.drafted, stats.accepted, strict=True):
        assert drafts[0] == int(forced[n - 1])
        n += 1 + a
    assert 0 in stats.accepted and sum(stats.accepted) > 0  # rejections rolled back, acceptances kept


def test_fused_layers_travel_in_the_file_and_bad_settings_are_one_line_errors(tmp_path):
    from models.hf_io import save_hf

    model = _model()
    save_hf(model, tmp_path)
    heads = MTPHeads(CFG, 1, (1,))
    heads.init_weights(seed=0, trunk=model)
    save_mtp(dict(heads.named_parameters()), CFG, tmp_path, main_fingerprint(tmp_path),
             fuse_layers=heads.fuse_layers)
    loaded = load_mtp(tmp_path, model)
    assert loaded.fuse_layers == (1,)
    assert loaded.state_dict().keys() == heads.state_dict().keys()
    assert all(torch.equal(v, heads.state_dict()[k]) for k, v in loaded.state_dict().items())
    with pytest.raises(SmeltError, match=r"reads main-model blocks \[1\] \(fuse_layers\), the modules being "
                                         r"loaded read \[\]"):
        load_mtp_into(MTPHeads(CFG, 1), tmp_path)
    with pytest.raises(SmeltError, match=r"block 2 is not a block of the main model \(0..1\)"):
        MTPHeads(CFG, 1, (2,))
    for bad in (2, "2"):  # TOML `fuse_layers = 2`: the field is named, not a TypeError
        with pytest.raises(SmeltError, match="mtp.fuse_layers=.* must be a list of block indices"):
            MTPConfig(depth=1, fuse_layers=bad)
    # a trunk that lost a block its config still counts (depth removal before the config is renumbered)
    short = _model()
    del short.layers[list(short.layers)[-1]]
    with pytest.raises(SmeltError, match=r"mtp.fuse_layers: block 1 is not a block of this model \(0..0"):
        heads.level0(short, torch.zeros(1, 4, dtype=torch.long))
    for bad in ((-1,), (1, 1), (True,)):
        with pytest.raises(SmeltError, match="mtp.fuse_layers=.* must be distinct block indices >= 0"):
            MTPConfig(depth=1, fuse_layers=bad)
        with pytest.raises(SmeltError, match="mtp.fuse_layers=.* must be distinct block indices >= 0"):
            MTPHeads(CFG, 1, bad)
    with pytest.raises(SmeltError, match=r"mtp.fuse_layers=\[1\] needs mtp.depth >= 1"):
        MTPConfig(depth=0, fuse_layers=(1,))
    # a file whose metadata names a block this main model lacks, or no list at all: the file is named
    from safetensors.torch import save_file

    tensors = dict(heads.named_parameters())
    for text, message in (("5", "block 5 is not a block of the main model"), ("a,b", "is not a comma-separated")):
        save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(tmp_path / "mtp.safetensors"),
                  metadata={**mtp_metadata(tmp_path), "fuse_layers": text})
        with pytest.raises(SmeltError, match=f"mtp.safetensors: .*{message}"):
            load_mtp(tmp_path, model, check_fingerprint=False)
