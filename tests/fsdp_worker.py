"""Run under torchrun (2 gloo ranks) by tests/test_sharded_load.py: sharded loading and bf16 QAT units.

Argument: a tiny HF model directory. Writes rank 0's findings as JSON to $OUT.
"""
from __future__ import annotations

import gc
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from core.dtensor import local, local_slices
from models.hf_io import config_from_hf, load_hf, load_into, read_hf_config
from models.llama import Transformer
from qat.fake_quant import FakeQuantLinear, init_scales, swap_to_fake_quant
from qat.quantizers import QuantSpec
from train.titan import shard_model


def sharded(model_dir: str, mp: MixedPrecisionPolicy, fake_quant: bool) -> Transformer:
    """Built on meta, sharded, materialised, then filled from disk: how the trainer builds both models."""
    with torch.device("meta"):
        model = Transformer(config_from_hf(read_hf_config(model_dir)))
    if fake_quant:
        swap_to_fake_quant(model, QuantSpec(bits=4, symmetric=True, group_size=32), learn_scale=True)
    shard_model(model, model.layers.values(), init_device_mesh("cpu", (2,)), mp, gloo=True)
    model.to_empty(device="cpu")
    load_into(model, model_dir)
    model.init_rope("cpu")
    return model


def main() -> None:
    dist.init_process_group("gloo")
    model_dir = sys.argv[1]
    full = load_hf(model_dir)
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    model = sharded(model_dir, fp32, fake_quant=False)
    params = dict(full.named_parameters())
    shards_equal = all(torch.equal(local(p), params[n].detach()[local_slices(p)])
                       for n, p in model.named_parameters())
    local_numel = sum(local(p).numel() for p in model.parameters())
    tokens = torch.randint(0, full.cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        same_logits = torch.equal(model(tokens), full(tokens))
    # bf16 compute: fake-quantized linears must still see (and quantize) fp32 weights.
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    qmodel = sharded(model_dir, bf16, fake_quant=True)
    init_scales(qmodel)
    seen = {}

    def record(mod, args, name):
        seen[name] = str(mod.weight.dtype)

    for name, m in qmodel.named_modules():
        if isinstance(m, FakeQuantLinear):
            m.register_forward_pre_hook(lambda mod, args, name=name: record(mod, args, name))
    out = qmodel(tokens)
    out.float().sum().backward()
    result = {"shards_equal": shards_equal, "same_logits": same_logits, "local_numel": local_numel,
              "full_numel": sum(p.numel() for p in full.parameters()), "fq_weight_dtypes": seen,
              "logits_dtype": str(out.dtype),
              "grad_dtypes": sorted({str(local(p.grad).dtype) for p in qmodel.parameters() if p.grad is not None})}
    if dist.get_rank() == 0:
        with open(os.environ["OUT"], "w") as f:
            json.dump(result, f)
    # Drop every FSDP module (and the gloo work objects their hooks hold) and line the ranks up before
    # the group goes: tearing gloo down under live work aborted both ranks once in CI (SIGABRT,
    # "terminate called without an active exception").
    del model, qmodel, out
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
