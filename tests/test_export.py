"""train.export: the trainer's export gathers a student that lives on another device than the export model.

A GPU is stood in for by PyTorch's FakeTensorMode with a `cuda` device: every op on the fakes checks its
devices as CUDA would, so an export that mixed the student's device with the CPU model fails here.
"""
from __future__ import annotations

import torch
from conftest import tiny_config
from torch._subclasses.fake_tensor import FakeTensorMode

from models.llama import Transformer
from models.mtp import MTPHeads
from qat.fake_quant import swap_to_fake_quant
from qat.quantizers import QuantSpec
from train.export import empty_cpu_copy, gather


def test_the_export_gathers_a_qat_student_with_masks_and_mtp_heads_from_a_gpu_onto_the_cpu():
    cfg = tiny_config()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode, torch.device("cuda"):
        student = Transformer(cfg)
        names = swap_to_fake_quant(student, QuantSpec(group_size=32), learn_scale=True)
        heads = MTPHeads(cfg, depth=1)
    cpu_model = empty_cpu_copy(student)  # the export's own model: real CPU tensors
    with mode:
        modules = dict(student.named_modules())
        pairs = [(n, modules[n].weight, torch.ones_like(modules[n].weight, dtype=torch.bool)) for n in names[:2]]
        assert student.tok_embeddings.weight.device.type == "cuda"
        assert modules[names[0]].weight_scale.device.type == "cuda"
        g = gather(student, pairs, heads, into=cpu_model)
    tensors = {**{f"model.{k}": v for k, v in g.model.state_dict().items()},
               **{f"codes.{k}": t for k, f in g.frozen.items() for t in f if t is not None},
               **{f"mask.{k}": v for k, v in g.masks.items()}, **{f"mtp.{k}": v for k, v in g.mtp.items()}}
    assert set(g.frozen) == set(names) and len(g.masks) == 2 and g.mtp
    off = {k: str(v.device) for k, v in tensors.items() if v.device.type != "cpu"}
    assert not off, f"gathered off the CPU: {sorted(off.items())[:3]}"
