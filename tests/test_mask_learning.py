"""Masks that keep learning (SR-STE and MaskLLM, train.masks): the maths, the mechanism, and the trainer around it."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import check_offline_export, launch_log, make_byte_tokenizer, make_distill_dirs, tiny_config
from safetensors.torch import load_file
from test_trainer import kill_after_checkpoint, torchrun

from core.errors import SmeltError
from core.masks import load_dense_rows, load_masks, save_masks
from core.patterns import NMPattern
from models.hf_io import load_hf, save_hf
from models.llama import build_model
from train.masks import (
    MaskLearningConfig,
    MaskSet,
    candidates,
    changed_groups,
    hard_mask,
    prior_logits,
    reselect,
    soft_mask,
)

NM = NMPattern(2, 4)


def test_reselect_keeps_the_two_largest_per_group_and_pinned_rows():
    w = torch.tensor([[0.1, -3.0, 2.0, 0.5, 1.0, 1.0, -1.0, 0.0],
                      [0.0, 0.0, 0.0, 9.0, 0.1, 0.2, 0.3, 0.4]])
    pinned = torch.zeros_like(w, dtype=torch.bool)
    keep = reselect(w, NM, pinned)
    assert keep[0, :4].tolist() == [False, True, True, False]
    assert keep.reshape(-1, 4).sum(-1).tolist() == [2, 2, 2, 2]  # exactly 2 of 4, ties included
    pinned[1] = True
    assert reselect(w, NM, pinned)[1].all()
    before = torch.tensor([[True, True, False, False, True, True, False, False]])
    after = torch.tensor([[True, False, True, False, True, True, False, False]])
    assert changed_groups(before, after, 4) == 1 and changed_groups(before, before, 4) == 0


def _two_of_four(model, dense_row: int | None = None):
    """Magnitude 2:4 masks on every w1 and wq (wq keeps row `dense_row` dense), applied to the model."""
    masks, dense = {}, {}
    with torch.no_grad():
        for name, mod in model.named_modules():
            if name.endswith(("feed_forward.w1", "attention.wq")):
                masks[name] = NM.keep_top(mod.weight.abs())
                if dense_row is not None and name.endswith("wq"):
                    dense[name] = torch.zeros(mod.weight.shape[0], dtype=torch.bool)
                    dense[name][dense_row] = True
                    masks[name][dense_row] = True
                mod.weight.mul_(masks[name])
    return masks, dense


def test_srste_moves_masks_keeps_the_pattern_and_freezes():
    torch.manual_seed(0)
    model = build_model(tiny_config(), seed=0)
    masks, dense = _two_of_four(model, dense_row=3)
    steps, cfg = 10, MaskLearningConfig(mode="srste", decay=0.0, freeze_fraction=0.6)
    ms = MaskSet(model, masks, cfg, dense, steps)
    assert ms.last_select == 6
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.0)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    wq = model.layers["0"].attention.wq.weight
    frozen_mask = None
    for step in range(1, steps + 1):
        opt.zero_grad()
        model(tokens).logsumexp(-1).mean().backward()
        ms.apply_to_grads(step)
        pruned_grad = wq.grad[~{n: m for n, _, m in ms.pairs}["layers.0.attention.wq"]]
        assert (pruned_grad.abs().max() > 0) == (step <= ms.last_select)  # STE while selecting, then zeroed
        ms.before_step(step)
        opt.step()
        ms.after_step(step)
        for name, w, m in ms.pairs:
            assert NM.holds(w, dense.get(name)) and torch.equal(w != 0, m)  # kept weights live, removed ones 0
        if step == ms.last_select:
            frozen_mask = {n: m.clone() for n, _, m in ms.pairs}
    changed = sum(int(changed_groups(masks[n], m, 4)) for n, _, m in ms.pairs)  # against the artifact's masks
    groups = sum(m.numel() // 4 for _, _, m in ms.pairs)
    assert 0 < changed < groups  # the masks did move, and not everywhere
    assert all(torch.equal(frozen_mask[n], m) for n, _, m in ms.pairs)  # frozen after the schedule's end
    assert (wq[3] != 0).all()  # the declared dense row stayed dense


def test_srste_decay_pulls_pruned_latents_to_zero():
    model = build_model(tiny_config(), seed=0)
    w = model.layers["0"].feed_forward.w1.weight
    keep = NM.keep_top(w.abs())
    ms = MaskSet(model, {"layers.0.feed_forward.w1": keep}, MaskLearningConfig(mode="srste", decay=0.5), {}, 4)
    lat = ms.latent["layers.0.feed_forward.w1"]
    with torch.no_grad():
        lat.fill_(1.0)
    w.grad = torch.zeros_like(w)
    ms.before_step(1)
    assert torch.allclose(w.grad[~keep], torch.full_like(w.grad[~keep], 0.5)) and (w.grad[keep] == 0).all()
    assert torch.equal(w, lat)  # the optimizer steps the latents


def test_srste_refuses_a_mask_off_its_pattern_and_bad_settings():
    model = build_model(tiny_config(), seed=0)
    w = model.layers["0"].feed_forward.w1.weight
    unstructured = w.abs() > w.abs().median()
    with pytest.raises(SmeltError, match="does not hold it"):
        MaskSet(model, {"layers.0.feed_forward.w1": unstructured}, MaskLearningConfig(mode="srste"), {}, 4)
    for kw, named in (({"freeze_fraction": 1.0}, "ends unfrozen"), ({"mode": "gumbel"}, "mask_learning.mode"),
                      ({"pattern": "4:2"}, "mask_learning.pattern"), ({"every": 0}, "mask_learning.every"),
                      ({"decay": -1.0}, "mask_learning.decay")):
        with pytest.raises(SmeltError, match=named):
            MaskLearningConfig(**kw)


def test_maskllm_maths_candidates_prior_and_soft_masks():
    cands = candidates(NM)
    assert cands.shape == (6, 4) and (cands.sum(-1) == 2).all() and len({tuple(r.tolist()) for r in cands}) == 6
    w = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    keep = NM.keep_top(w.abs())
    logits = prior_logits(keep, cands, 3.0)
    assert logits.shape == (8, 4, 6) and (logits.sum(-1) == 3.0).all()
    assert torch.equal(hard_mask(logits, cands), keep)  # the prior's argmax is the artifact's mask
    noise = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1))
    soft = soft_mask(logits, noise, 1.0, cands)
    assert soft.shape == w.shape and torch.allclose(soft.reshape(8, 4, 4).sum(-1), torch.full((8, 4), 2.0))
    assert ((soft > 0) & (soft < 1)).all()  # every entry is a mixture at tau 1
    cold = soft_mask(logits, torch.zeros_like(noise), 1e-3, cands)
    assert torch.allclose(cold, keep.float())  # tau -> 0 without noise: the argmax candidate
    probe = logits.clone().requires_grad_(True)
    soft_mask(probe, noise, 1.0, cands).mul(w).sum().backward()
    assert probe.grad.abs().sum() > 0  # the loss reaches the logits
    cfg = MaskLearningConfig(mode="maskllm", tau_start=2.0, tau_end=0.02)
    assert cfg.tau(1, 5) == 2.0 and abs(cfg.tau(5, 5) - 0.02) < 1e-12 and abs(cfg.tau(3, 5) - 0.2) < 1e-12


def _maskllm_run(steps: int = 10, **kw):
    """A tiny model pruned 2:4 (wq row 3 dense) from a dense copy, then `steps` maskllm steps on a toy loss."""
    torch.manual_seed(0)
    model = build_model(tiny_config(), seed=0)
    dense = build_model(tiny_config(), seed=0)
    masks, rows = _two_of_four(model, dense_row=3)
    cfg = MaskLearningConfig(mode="maskllm", freeze_fraction=0.6, **kw)
    ms = MaskSet(model, masks, cfg, rows, steps, dense_source=dense)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.0)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    return model, dense, masks, rows, ms, opt, tokens


def test_maskllm_trains_soft_masks_splits_the_gradient_and_freezes_exact():
    model, dense, masks, rows, ms, opt, tokens = _maskllm_run(prior=0.5, logit_lr=0.5)
    name = "layers.0.attention.wq"
    w, lat = dict(model.named_modules())[name].weight, ms.latent[name]
    dw = dict(dense.named_modules())[name].weight
    assert torch.equal(lat[~masks[name]], dw[~masks[name]]) and torch.equal(lat[masks[name]], w[masks[name]])
    idx = [n for n, _, _ in ms.pairs].index(name)
    frozen = None
    for step in range(1, 11):
        opt.zero_grad()
        ms.before_forward(step)
        if ms.selecting(step):
            soft = ms._soft(idx, name, step)
            assert torch.allclose(w, lat * soft) and not NM.holds(w, rows[name]) and torch.equal(w[3], lat[3])
        model(tokens).logsumexp(-1).mean().backward()
        ms.apply_to_grads(step)
        g, before = w.grad.clone(), ms.logits[name].clone()
        ms.before_step(step)
        if ms.selecting(step):  # the latent's gradient is G x soft mask; the logits took their own step
            assert torch.allclose(w.grad, g * soft) and not torch.equal(ms.logits[name], before)
            assert torch.equal(w, lat)
        opt.step()
        ms.after_step(step)
        for n, wt, m in ms.pairs:
            assert NM.holds(wt, rows.get(n)) and torch.equal(wt != 0, m)  # between steps: exact 2:4
        if step == ms.last_select:
            frozen = {n: m.clone() for n, _, m in ms.pairs}
    changed = sum(int(changed_groups(masks[n], m, 4)) for n, _, m in ms.pairs)
    assert 0 < changed < sum(m.numel() // 4 for _, _, m in ms.pairs)
    assert all(torch.equal(frozen[n], m) for n, _, m in ms.pairs)
    assert (w[3] != 0).all()


def test_maskllm_is_seeded_and_refuses_what_it_cannot_start_from():
    finals = []
    for _ in range(2):
        model, _, _, _, ms, opt, tokens = _maskllm_run(steps=4, prior=0.5, logit_lr=0.5)
        for step in range(1, 5):
            opt.zero_grad()
            ms.before_forward(step)
            model(tokens).logsumexp(-1).mean().backward()
            ms.apply_to_grads(step)
            ms.before_step(step)
            opt.step()
            ms.after_step(step)
        finals.append({k: v.clone() for k, v in model.state_dict().items()})
    assert all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])
    model = build_model(tiny_config(), seed=0)
    masks, _ = _two_of_four(model)
    with pytest.raises(SmeltError, match="maskllm: the teacher has no layers"):
        MaskSet(model, masks, MaskLearningConfig(mode="maskllm"), {}, 4)
    for kw, named in (({"tau_start": 0.0}, "tau_start"), ({"tau_end": -1.0}, "tau_end"),
                      ({"logit_lr": 0.0}, "logit_lr"), ({"prior": -1.0}, "mask_learning.prior")):
        with pytest.raises(SmeltError, match=named):
            MaskLearningConfig(mode="maskllm", **kw)


@pytest.fixture(scope="module")
def srste_dirs(tmp_path_factory):
    """dirs/teacher (the trainer tests' teacher) and dirs/student: it with 2:4 magnitude masks on w1 and wq,
    row 3 of each wq declared dense."""
    root = make_distill_dirs(tmp_path_factory.mktemp("srste"))
    student = load_hf(root / "teacher")
    masks, dense = _two_of_four(student, dense_row=3)
    shutil.rmtree(root / "student")
    save_hf(student, root / "student", tokenizer=make_byte_tokenizer())
    save_masks(student, masks, root / "student", dense)
    return root


SRSTE = ("--mask_learning.mode", "srste", "--mask_learning.freeze_fraction", "0.5", "--optimizer.param-groups.0.optimizer-kwargs.lr", "0.05",
         "--training.steps", "8")
MASKLLM = ("--mask_learning.mode", "maskllm", "--mask_learning.freeze_fraction", "0.5", "--mask_learning.prior", "0.5",
           "--mask_learning.logit_lr", "0.5", "--training.steps", "8")


@pytest.mark.parametrize("mode,args", [("srste", SRSTE), ("maskllm", MASKLLM)])
def test_the_trainer_learns_2of4_masks_exports_them_exact_and_resumes_bit_identical(srste_dirs, mode, args):
    straight = torchrun(srste_dirs, mode, *args)
    assert straight.returncode == 0, launch_log(straight)
    out = srste_dirs / f"{mode}-out"
    masks, dense = load_masks(out), load_dense_rows(out)
    start = load_masks(srste_dirs / "student")
    assert masks.keys() == start.keys() and dense.keys() == {n for n in start if n.endswith("wq")}
    model = load_hf(out)
    mods = dict(model.named_modules())
    for name, m in masks.items():
        w = mods[name].weight
        assert NM.holds(m, dense.get(name)) and NM.holds(w, dense.get(name))  # exact 2:4 outside dense rows
        assert (w[~m] == 0).all()
        if name in dense:
            assert (w[dense[name]] != 0).all()
    learned = json.loads((out / "manifest.json").read_text())["settings"]["mask_learning"]
    changed = sum(changed_groups(start[n], masks[n], 4) for n in masks)
    assert learned["mode"] == mode and learned["changed_groups"] == changed > 0
    assert learned["groups"] == sum(m.numel() // 4 for m in masks.values())
    # the checkpoints hold the current masks: the same artifact offline
    check_offline_export(srste_dirs / mode / "checkpoint" / "step-8", out, srste_dirs / f"{mode}-offline")
    # Killed after a checkpoint inside the selecting phase (step 2 or 4 of 8, freeze after 4): the resumed
    # run continues the latents and masks, not the artifact's, and ends bit-identical.
    name = f"{mode}-killed"
    kill_after_checkpoint(srste_dirs, name, *args, seed=1)
    resumed = torchrun(srste_dirs, name, *args)
    assert resumed.returncode == 0, launch_log(resumed)
    for file in ("model.safetensors", "masks.safetensors"):
        a, b = load_file(str(out / file)), load_file(str(srste_dirs / f"{name}-out" / file))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_trainer_refuses_srste_without_masks_or_in_qat(srste_dirs, tmp_path):
    from train import cpu_shims

    cpu_shims.apply()
    from train.config_registry import debug_distill, debug_qat
    from train.trainer import check_config

    cfg = debug_distill()
    cfg.student, cfg.mask_learning = str(srste_dirs / "teacher"), MaskLearningConfig(mode="srste")
    with pytest.raises(SmeltError, match="has no masks.safetensors"):
        check_config(cfg)
    cfg = debug_qat()
    cfg.student, cfg.mask_learning = str(srste_dirs / "student"), MaskLearningConfig(mode="srste")
    with pytest.raises(SmeltError, match="QAT and MTP stages keep the masks"):
        check_config(cfg)
    cfg = debug_distill()
    cfg.student, cfg.teacher = str(srste_dirs / "student"), ""
    cfg.mask_learning = MaskLearningConfig(mode="maskllm")
    with pytest.raises(SmeltError, match="maskllm needs a --teacher model"):
        check_config(cfg)


def test_masks_are_read_per_rank_rows_and_dense_rows_without_the_masks(tmp_path, monkeypatch):
    """The trainer's MaskSet reads masks.safetensors through MasksOnDisk: each rank reads its rows of each mask
    (local_slices of the weight), and the dense rows come without reading a mask."""
    import core.sidefiles
    from core.masks import MasksOnDisk

    model = build_model(tiny_config(), seed=0)
    name = "layers.0.feed_forward.w1"
    keep = NMPattern(2, 4).keep_top(torch.randn(model.layers["0"].feed_forward.w1.weight.shape))
    rows = torch.zeros(keep.shape[0], dtype=torch.bool)
    rows[:3] = True
    keep[rows] = True
    save_masks(model, {name: keep}, tmp_path, {name: rows})
    on_disk = MasksOnDisk(tmp_path)
    assert on_disk.names() == [name] and on_disk.shape(name) == tuple(keep.shape)
    assert torch.equal(on_disk.part(name, (slice(5, 9), slice(0, keep.shape[1]))), keep[5:9])
    read = []
    monkeypatch.setattr(core.sidefiles.SideFileOnDisk, "__getitem__",
                        lambda self, item, get=core.sidefiles.SideFileOnDisk.__getitem__: read.append(item) or get(self, item))
    assert torch.equal(load_dense_rows(tmp_path)[name], rows) and read == [(name, "weight_dense_rows")]
    a = MaskSet(model, on_disk, MaskLearningConfig(mode="srste"), {name: rows}, 4)
    b = MaskSet(model, load_masks(tmp_path), MaskLearningConfig(mode="srste"), {name: rows}, 4)
    assert [(n, torch.equal(m, keep)) for n, _, m in a.pairs] == [(name, True)]
    assert torch.equal(a.pinned[name], b.pinned[name])
