"""Needle-in-a-haystack prompts, shared by the needle evaluation (eval.needle, haystack = evaluation text)
and retrieval-head scoring (prune.heads, haystack = training text: scoring is calibration).

A prompt of exactly `length` tokens is BOS + haystack tokens with a needle sentence inserted at `depth`
(0 = right after BOS, 1 = just before the question), then a completion-style question whose answer is the
needle's 4-digit value. Names (made-up syllables), values and where in the haystack text each prompt starts
come from a seeded generator.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from core.data import NEEDLE_DTYPES, bos_id
from core.errors import SmeltError

SYLLABLES = ("tal", "vor", "em", "sk", "ka", "ri", "dun", "mel", "os", "ta", "bri", "gan", "lo", "we", "zu")
TEMPLATES = {  # needle, question (completion style: the answer is the next tokens)
    "en": (" The secret number of {name} is {value}. ",
           "\nQuestion: What is the secret number of {name}?\nAnswer: The secret number of {name} is"),
    "zh": ("{name}的秘密数字是{value}。", "\n问题：{name}的秘密数字是多少？\n答案：{name}的秘密数字是"),
}


@dataclass
class NeedleConfig:
    lengths: tuple = (256, 512, 1024, 2048)  # prompt tokens: BOS + haystack + needle + question
    depths: tuple = (0.0, 0.25, 0.5, 0.75, 1.0)  # where the needle sits in the haystack
    samples: int = 4  # prompts per (length, depth) cell
    languages: tuple = ("en",)  # en (WikiText-2 test), zh (the zh bucket)
    seed: int = 0
    max_new_tokens: int = 8
    batch_size: int = 2
    # bfloat16: prompts run through a bf16 copy of the model (fp32 RoPE tables and logits' argmax as ever):
    # 1.48x faster on the 2-core CPU; on the teacher every answer's number equals fp32's (docs/performance.md)
    dtype: str = "float32"

    def __post_init__(self):
        self.lengths, self.depths, self.languages = tuple(self.lengths), tuple(self.depths), tuple(self.languages)
        if not self.lengths or not all(isinstance(n, int) and n >= 64 for n in self.lengths):
            raise SmeltError(f"needle lengths={list(self.lengths)} must be integers >= 64")
        if not self.depths or not all(isinstance(d, (int, float)) and 0 <= d <= 1 for d in self.depths):
            raise SmeltError(f"needle depths={list(self.depths)} must be numbers in [0, 1]")
        for name in ("samples", "max_new_tokens", "batch_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise SmeltError(f"needle {name}={getattr(self, name)!r} must be an integer >= 1")
        if self.dtype not in NEEDLE_DTYPES:
            raise SmeltError(f"needle dtype={self.dtype!r} is not float32 or bfloat16")
        unknown = [lang for lang in self.languages if lang not in TEMPLATES]
        if unknown or not self.languages:
            raise SmeltError(f"needle languages={list(self.languages)}: each one of {', '.join(TEMPLATES)}")


def _name(rng: torch.Generator) -> str:
    def word(n: int) -> str:
        picks = torch.randint(len(SYLLABLES), (n,), generator=rng).tolist()
        return "".join(SYLLABLES[i] for i in picks).capitalize()
    return f"{word(2)} {word(2)}"


def make_prompts(tokenizer, cfg: NeedleConfig, lang: str, length: int, haystack: torch.Tensor) -> list[dict]:
    """The prompts of one length, every depth x sample: token ids (exactly `length`), the value, and the
    needle's token span [start, end) in the ids. `haystack`: 1-D token ids of the text to hide it in."""
    rng = torch.Generator().manual_seed(cfg.seed * 1_000_003 + length * 7 + list(TEMPLATES).index(lang))
    needle_t, question_t = TEMPLATES[lang]
    out = []
    for depth in cfg.depths:
        for _ in range(cfg.samples):
            name, value = _name(rng), int(torch.randint(1000, 10000, (1,), generator=rng))
            needle = tokenizer(needle_t.format(name=name, value=value), add_special_tokens=False)["input_ids"]
            question = tokenizer(question_t.format(name=name), add_special_tokens=False)["input_ids"]
            room = length - 1 - len(needle) - len(question)
            if room < 1:
                raise SmeltError(f"needle length {length}: the needle and question alone take "
                                 f"{length - 1 - room} tokens; use longer lengths")
            if room > len(haystack):
                raise SmeltError(f"needle length {length}: bucket {lang} has only {len(haystack)} tokens")
            start = int(torch.randint(0, len(haystack) - room + 1, (1,), generator=rng))
            hay = haystack[start:start + room].tolist()
            at = round(depth * room)
            ids = [bos_id(tokenizer), *hay[:at], *needle, *hay[at:], *question]
            out.append({"ids": ids, "value": value, "name": name, "depth": depth, "length": length,
                        "needle_span": (1 + at, 1 + at + len(needle))})
    return out
