"""On-policy distillation (GKD, Agarwal et al. 2024): a share of the steps train on text the student wrote.

Teacher-forced KD only ever shows the student the data's prefixes; at inference it continues its own,
and its errors compound where it was never corrected (exposure bias). On an on-policy step each window
keeps its first `prompt_tokens` tokens and the student samples the rest (KV cache, `temperature`,
`top_p`); the teacher then scores that sequence and the loss is the same KL on every position.

The sampling runs on a gathered copy of the student (one all-gather per on-policy step, the same order on
every rank), so decoding costs no collective per token. That copy is a whole model per rank: right for
the CPU recipe and small students on GPUs, not for a 70B student (a serving engine would sample there;
not built). Steps are chosen evenly (`share` 0.25: steps 4, 8, 12, ...); the sampling generator is seeded
from (seed, step, rank, micro-batch), so a resumed run samples the same text.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from core.errors import SmeltError
from models.generate import sample


@dataclass(kw_only=True, slots=True)
class OnPolicyConfig:
    """`--on_policy.*`: off unless share > 0."""
    share: float = 0.0        # fraction of the steps whose windows the student writes (0: off, 1: all)
    prompt_tokens: int = 32   # tokens of each data window kept as the prompt (the BOS included)
    temperature: float = 1.0  # the student's sampling temperature (> 0: GKD samples, it does not argmax)
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not 0 <= self.share <= 1:
            raise SmeltError(f"--on_policy.share={self.share} must be in [0, 1]")
        if self.prompt_tokens < 1:
            raise SmeltError(f"--on_policy.prompt_tokens={self.prompt_tokens} must be >= 1")
        if not self.temperature > 0:
            raise SmeltError(f"--on_policy.temperature={self.temperature} must be > 0")
        if not 0 < self.top_p <= 1:
            raise SmeltError(f"--on_policy.top_p={self.top_p} must be in (0, 1]")

    def is_on_policy(self, step: int) -> bool:
        """Whether `step` (1-based) trains on the student's text: evenly spread, share x steps of them."""
        return self.share > 0 and int(step * self.share) > int((step - 1) * self.share)


def student_windows(policy, inputs: torch.Tensor, labels: torch.Tensor, cfg: OnPolicyConfig,
                    generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) of windows that keep the data's first prompt_tokens tokens and continue with the
    student's samples, the same shape as the data's."""
    window = torch.cat([inputs, labels[:, -1:]], dim=1)  # [B, L + 1]
    if cfg.prompt_tokens >= window.shape[1]:  # train.trainer.check_config says so before any rank starts
        raise SmeltError(f"--on_policy.prompt_tokens={cfg.prompt_tokens} leaves nothing to sample in "
                         f"{window.shape[1]}-token windows")
    prompt = window[:, :cfg.prompt_tokens]
    out = sample(policy, prompt, window.shape[1] - cfg.prompt_tokens, cfg.temperature, cfg.top_p,
                 generator=generator)
    return out[:, :-1].contiguous(), out[:, 1:].contiguous()
