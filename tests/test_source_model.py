"""models.source_model: the same weights give the same logits and the same MTP acceptance whether the model
is loaded once or streams its blocks, embedding rows and head blocks (how a model larger than memory runs)."""
from __future__ import annotations

import pytest
import torch

from models.llama import FLAVORS, build_model
from models.mtp import MTPHeads
from models.source_model import source_model
from models.speculative import acceptance_probe


class DictSource:
    """Weights from a state dict; the head in blocks of 100 rows (so the streamed head concatenates)."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self.state, self.reads = state, []

    def get(self, name):
        self.reads.append(name)
        return self.state[name].clone()

    def rows(self, name, ids):
        return self.state[name][ids].clone()

    def row_blocks(self, name):
        w = self.state[name]
        yield from (w[a:a + 100].clone() for a in range(0, w.shape[0], 100))


@pytest.mark.parametrize("flavor", ["debug", "debug-untied"])
def test_streamed_model_matches_the_resident_one(flavor):
    cfg = FLAVORS[flavor]
    ref = build_model(cfg, seed=3).eval()
    src = DictSource({k: v.detach() for k, v in ref.state_dict().items()})
    tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    resident, streamed = source_model(cfg, src, resident=True), source_model(cfg, src, resident=False)
    with torch.no_grad():
        want = ref(tokens)
        assert torch.equal(resident(tokens), want)
        assert torch.allclose(streamed(tokens), want, rtol=0, atol=1e-5)
    # streamed: no block keeps its weights between forwards
    assert all(p.is_meta for p in streamed.layers.parameters())
    src.reads.clear()
    with torch.no_grad():
        streamed(tokens)
    assert sorted(n for n in src.reads if n.startswith("layers.")) == sorted(k for k in ref.state_dict() if k.startswith("layers."))
    heads = MTPHeads(cfg, 1)
    heads.init_weights(seed=1, trunk=ref)
    prompts = [tokens[0, :6].tolist(), tokens[1, :5].tolist()]
    with torch.no_grad():
        a = acceptance_probe(resident, heads.eval(), prompts, 8)
        b = acceptance_probe(streamed, heads, prompts, 8)
    assert a == b
