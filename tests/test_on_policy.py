"""On-policy distillation: the step schedule, the student's continuations, and the trainer training on them
(seeded, so a killed run resumes bit-identical), with its refusals."""
from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import launch_log, make_distill_dirs, tiny_config
from safetensors.torch import load_file
from test_trainer import kill_after_checkpoint, torchrun

from core.errors import SmeltError
from models.llama import build_model
from train.on_policy import OnPolicyConfig, student_windows

ON = ("--on_policy.share", "0.5", "--on_policy.prompt_tokens", "8")


def test_the_schedule_spreads_share_x_steps_evenly_and_bad_settings_are_refused():
    cfg = OnPolicyConfig(share=0.25)
    assert [s for s in range(1, 13) if cfg.is_on_policy(s)] == [4, 8, 12]
    assert sum(OnPolicyConfig(share=0.3).is_on_policy(s) for s in range(1, 101)) == 30
    assert not any(OnPolicyConfig().is_on_policy(s) for s in range(1, 10))
    assert all(OnPolicyConfig(share=1.0).is_on_policy(s) for s in range(1, 10))
    for bad, field in (({"share": 1.5}, "share"), ({"prompt_tokens": 0}, "prompt_tokens"),
                       ({"temperature": 0.0}, "temperature"), ({"top_p": 0.0}, "top_p")):
        with pytest.raises(SmeltError, match=f"--on_policy.{field}="):
            OnPolicyConfig(**bad)


def test_student_windows_keep_the_prompt_and_continue_with_seeded_samples():
    model = build_model(tiny_config(max_seq_len=64), seed=0)
    window = torch.randint(3, 200, (2, 17), generator=torch.Generator().manual_seed(0))
    cfg = OnPolicyConfig(share=1.0, prompt_tokens=5)
    a = student_windows(model, window[:, :-1], window[:, 1:], cfg, torch.Generator().manual_seed(1))
    b = student_windows(model, window[:, :-1], window[:, 1:], cfg, torch.Generator().manual_seed(1))
    c = student_windows(model, window[:, :-1], window[:, 1:], cfg, torch.Generator().manual_seed(2))
    inputs, labels = a
    assert inputs.shape == labels.shape == (2, 16) and torch.equal(inputs[:, 1:], labels[:, :-1])
    assert torch.equal(inputs[:, :5], window[:, :5])  # the data's prompt, then the student's text
    assert not torch.equal(inputs[:, 5:], window[:, 5:16])
    assert torch.equal(inputs, b[0]) and not torch.equal(inputs, c[0])
    with pytest.raises(SmeltError, match="prompt_tokens=17 leaves nothing to sample"):
        student_windows(model, window[:, :-1], window[:, 1:], OnPolicyConfig(prompt_tokens=17),
                        torch.Generator())


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return make_distill_dirs(tmp_path_factory.mktemp("on-policy"))


def _losses(proc) -> list[float]:
    return [float(x) for x in re.findall(r"step:\s+\d+\s+loss:\s+([0-9.]+)", proc.stdout + proc.stderr)]


def test_the_trainer_trains_on_the_students_text_and_resumes_exactly(dirs):
    plain, on = torchrun(dirs, "plain"), torchrun(dirs, "on", *ON)
    assert plain.returncode == 0 and on.returncode == 0, launch_log(on)
    a, b = _losses(plain), _losses(on)
    # step 1 is teacher-forced in both; step 2 (share 0.5) is the student's text, so the runs part there
    assert len(a) == len(b) == 6 and a[0] == b[0] and a[1] != b[1]
    settings = json.loads((dirs / "on-out" / "manifest.json").read_text())["settings"]
    assert settings["on_policy"]["share"] == 0.5 and settings["on_policy"]["prompt_tokens"] == 8
    kill_after_checkpoint(dirs, "on-killed", *ON)
    resumed = torchrun(dirs, "on-killed", *ON)
    assert resumed.returncode == 0, launch_log(resumed)
    x, y = (load_file(str(dirs / f"{n}-out" / "model.safetensors")) for n in ("on", "on-killed"))
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_on_policy_is_refused_without_a_teacher_model_or_outside_recovery(dirs):
    from train import cpu_shims

    cpu_shims.apply()
    from train.config_registry import debug_distill, debug_qat
    from train.trainer import check_config

    cfg = debug_distill()
    cfg.student, cfg.on_policy = str(dirs / "student"), OnPolicyConfig(share=0.5)
    with pytest.raises(SmeltError, match="--on_policy.share 0.5 needs a --teacher"):
        check_config(cfg)
    cfg = debug_qat()
    cfg.student, cfg.teacher, cfg.on_policy = str(dirs / "student"), str(dirs / "teacher"), OnPolicyConfig(share=0.5)
    with pytest.raises(SmeltError, match="is for recovery"):
        check_config(cfg)
    cfg = debug_distill()
    cfg.student, cfg.teacher, cfg.on_policy = str(dirs / "student"), str(dirs / "teacher"), OnPolicyConfig(share=0.5)
    cfg.loss.ce_weight = 0.5
    with pytest.raises(SmeltError, match="ce_weight 0.5 would train the student on its own samples"):
        check_config(cfg)
    proc = torchrun(dirs, "long-prompt", "--on_policy.share", "0.5", "--on_policy.prompt_tokens", "33")
    assert proc.returncode != 0 and "prompt_tokens=33 leaves nothing to sample in 33-token windows" in proc.stderr
    assert not (dirs / "long-prompt-out").exists()
