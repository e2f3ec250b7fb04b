"""Self-speculative decoding benchmark: how many tokens the model's own MTP modules buy per forward and
per second, against plain cached greedy decoding in the same run.

    python -m eval.speculative --model runs/smollm2/qat-2of4 --gamma 1 --out results/bench/mtp/spec.json
    python -m eval.speculative --model runs/smollm2/release  # a release: decompressed on load (models.load)

Prompts: `--prompts` per evaluation bucket (en, zh, code), each BOS + `--prompt-len` tokens of the bucket's
text at a seeded offset. Every prompt is decoded greedily `--new-tokens` tokens twice, plain
(models.generate.sample) and speculative (models.speculative), alternating which goes first; the two
outputs must be identical (exactness is checked, not assumed). Reported per bucket and overall:
- alpha: acceptance rate of the first drafted token, per prompt too, with its standard error clustered by
  prompt (models.speculative.alpha_standard_error: rounds within a prompt are not independent); mean accepted
  drafts per round; tokens per main forward; the i.i.d. prediction (1 - alpha^(gamma+1)) / (1 - alpha) of
  tokens per forward;
- tokens/s of both and their ratio; and the ceiling: with every draft accepted a round yields gamma + 1
  tokens for one verification forward plus gamma module steps, so speedup <= (gamma + 1) / (r + gamma * c),
  where c is a draft step's time and r a verification forward's, both relative to one plain decode step
  (measured here).
`--draft-vocab N` drafts from the N most frequent tokens of a training corpus only (models.speculative.DraftVocab;
FR-Spec, Zhao et al. 2025): a cheaper draft step, the same exact output, possibly fewer accepted drafts.
Both decoders run with `models.generate.small_m_linears` (fp32 Linears on a CPU compute their few decode
rows in whichever form, x @ Wᵀ or W @ xᵀ, timed fastest on this machine; the plan is in the JSON;
docs/mtp.md) unless `--no-small-m`, which keeps F.linear everywhere.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from core.data import BUCKETS, bucket_prompts, corpus_tokens, split_corpora
from core.device import machine_record
from core.errors import ArgumentParser, SmeltError, run_cli
from core.files import atomic_write_text
from models.generate import sample, small_m_linears
from models.hf_io import load_tokenizer
from models.load import load_model, load_model_mtp
from models.mtp import mtp_metadata
from models.speculative import (
    DraftVocab,
    acceptance_summary,
    alpha_standard_error,
    frequent_token_ids,
    speculative_generate,
)
from models.teacher import DEFAULT_TEACHER, resolve_teacher


@torch.no_grad()
def step_costs(model, heads, prompt: torch.Tensor, gamma: int, repeats: int = 20,
               draft_vocab: DraftVocab | None = None) -> dict[str, float]:
    """Seconds of one plain decode step, one draft step (MTP module + head) and one (gamma+1)-token
    verification forward, after a prefill of `prompt`."""
    cache = model.new_cache(1, prompt.shape[1] + repeats * (gamma + 2) + 2)
    _, x0 = heads.level0(model, prompt, cache)
    tok = prompt[:, -1:]  # on the model's device, as the prompt is
    mcache = heads.new_cache(1, prompt.shape[1] + 2)[0]
    module = heads.mtp[0]
    emb = model.tok_embeddings(tok)
    cos, sin = model.rope_cos[:1], model.rope_sin[:1]
    times = {"decode": [], "draft": [], "verify": []}
    for _ in range(repeats):
        t0 = time.perf_counter()
        model(tok, cache)
        t1 = time.perf_counter()
        (model.output if draft_vocab is None else draft_vocab)(module.norm(module(x0[:, -1:], emb, cos, sin, mcache)))
        mcache.truncate(0)
        t2 = time.perf_counter()
        model(tok.expand(1, gamma + 1), cache)
        t3 = time.perf_counter()
        times["decode"].append(t1 - t0)
        times["draft"].append(t2 - t1)
        times["verify"].append(t3 - t2)
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}  # medians


@torch.no_grad()  # a decorator, not set_grad_enabled: main() also runs inside other processes (tests)
def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(prog="python -m eval.speculative", description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="artifact or release directory with mtp.safetensors")
    ap.add_argument("--teacher", default=DEFAULT_TEACHER, help="tokenizer source when the model has none")
    ap.add_argument("--gamma", type=int, default=1, help="drafted tokens per round (<= the MTP depth)")
    # 16, not 4: rounds within one prompt are not independent, and 4 prompts per bucket gave alpha 0.600 where
    # 16 gave 0.508 on the same module (docs/mtp.md)
    ap.add_argument("--prompts", type=int, default=16, help="prompts per bucket")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--languages", default="en,zh,code")
    ap.add_argument("--any-main-model", action="store_true",
                    help="allow MTP modules trained against another main model (e.g. before QAT)")
    ap.add_argument("--small-m", action=argparse.BooleanOptionalAction, default=True,
                    help="decode rows by the form of product timed fastest here, on CPU fp32 Linears (both decoders "
                         "alike; --no-small-m: F.linear)")
    ap.add_argument("--draft-vocab", type=int, default=0,
                    help="draft from the N most frequent tokens of --draft-vocab-corpus only (0: the whole head)")
    ap.add_argument("--draft-vocab-corpus", default="wikitext2-valid+code-train+zh-train",
                    help="training corpora ('+'-joined) whose token counts choose the draft vocabulary")
    ap.add_argument("--out", help="JSON report")
    args = ap.parse_args(argv)
    langs = [s.strip() for s in args.languages.split(",") if s.strip()]
    bad = [lang for lang in langs if lang not in BUCKETS]
    if bad or not langs:
        raise SmeltError(f"--languages: {bad[0] if bad else '(empty)'} is not one of {', '.join(BUCKETS)}")
    if args.gamma < 1:
        raise SmeltError(f"--gamma {args.gamma} must be >= 1")
    if args.prompts < 1 or args.prompt_len < 2 or args.new_tokens < 1:
        raise SmeltError("--prompts >= 1, --prompt-len >= 2 and --new-tokens >= 1 are required")
    meta = mtp_metadata(args.model)
    if meta is None:
        raise SmeltError(f"--model {args.model}: no mtp.safetensors (train one with the mtp stage)")
    if args.gamma > int(meta["depth"]):
        raise SmeltError(f"--gamma {args.gamma} exceeds the MTP depth {meta['depth']} of {args.model}")
    model = load_model(args.model)
    heads = load_model_mtp(args.model, model, any_main_model=args.any_main_model)
    tok_dir = args.model if (Path(args.model) / "tokenizer.json").is_file() else resolve_teacher(args.teacher)
    tokenizer = load_tokenizer(tok_dir)
    draft_vocab, vocab_record = _draft_vocab(model, tokenizer, args)
    roots = (model, heads) if draft_vocab is None else (model, heads, draft_vocab)
    with small_m_linears(*roots) if args.small_m else contextlib.nullcontext() as small_m:
        per, overall = _race(model, heads, tokenizer, langs, args, draft_vocab)
        costs = step_costs(model, heads, bucket_prompts(tokenizer, langs[0], 1, args.prompt_len)[0], args.gamma,
                           draft_vocab=draft_vocab)
    c, r = costs["draft"] / costs["decode"], costs["verify"] / costs["decode"]
    result = {"model": args.model, "gamma": args.gamma, "mtp": meta,
              "settings": {"prompts_per_bucket": args.prompts, "prompt_len": args.prompt_len,
                           "new_tokens": args.new_tokens, "languages": langs, "greedy": True, "batch": 1,
                           "small_m": args.small_m, "small_m_plan": small_m.record() if small_m else None,
                           "draft_vocab": vocab_record},
              "buckets": per,
              "overall": overall,
              "step_seconds": costs, "draft_cost": c, "verify_cost": r,
              "ceiling_speedup": (args.gamma + 1) / (r + args.gamma * c),
              "machine": machine_record(),
              "command": shlex.join(["python", "-m", "eval.speculative", *(sys.argv[1:] if argv is None else argv)])}
    o = result["overall"]
    se = "" if o["alpha_first_se"] is None else f" ± {o['alpha_first_se']:.3f} (prompt-clustered s.e.)"
    print(f"alpha {o['alpha_first']:.3f}{se}, accepted/round {o['mean_accepted']:.3f}, tokens/forward "
          f"{o['tokens_per_forward']:.3f} (iid prediction {o['predicted_tokens_per_forward']:.3f}), "
          f"{o['plain_tok_s']:.1f} -> {o['spec_tok_s']:.1f} tok/s ({o['speedup']:.2f}x; ceiling "
          f"{result['ceiling_speedup']:.2f}x at draft cost {c:.2f}, verify cost {r:.2f})")
    if args.out:
        atomic_write_text(args.out, json.dumps(result, indent=1) + "\n")


def _draft_vocab(model, tokenizer, args) -> tuple[DraftVocab | None, dict | None]:
    """The --draft-vocab subset and its record (size, corpus, the share of the corpus' tokens it covers)."""
    if args.draft_vocab == 0:
        return None, None
    V = model.cfg.vocab_size
    if not 0 < args.draft_vocab <= V:
        raise SmeltError(f"--draft-vocab {args.draft_vocab} must be within [0, {V}] (0: the whole head)")
    tokens = torch.cat([corpus_tokens(tokenizer, c) for c in split_corpora(args.draft_vocab_corpus)])
    ids = frequent_token_ids(tokens, args.draft_vocab, V)
    covered = torch.zeros(V, dtype=torch.bool)
    covered[ids] = True
    return DraftVocab(model.output, ids), {"size": args.draft_vocab, "corpus": args.draft_vocab_corpus,
                                           "corpus_coverage": float(covered[tokens].float().mean())}


def _race(model, heads, tokenizer, langs: list[str], args, draft_vocab: DraftVocab | None = None
          ) -> tuple[dict, dict]:
    """Decode every bucket's prompts plain and speculative (alternating which goes first), check the outputs
    are identical, and time both: ({bucket: summary}, overall summary)."""
    per, accepted_all = {}, []  # accepted_all: one list of accepted drafts per round for every prompt
    plain_s = spec_s = 0.0
    for lang in langs:
        prompts = bucket_prompts(tokenizer, lang, args.prompts, args.prompt_len)
        acc, p_s, s_s = [], 0.0, 0.0
        for i, prompt in enumerate(tqdm(prompts, desc=f"speculative {lang}", unit="prompt", leave=False)):
            order = ("plain", "spec") if i % 2 == 0 else ("spec", "plain")
            outs = {}
            for what in order:
                t0 = time.perf_counter()
                if what == "plain":
                    outs[what] = sample(model, prompt, args.new_tokens, temperature=0)
                    p_s += time.perf_counter() - t0
                else:
                    outs[what], stats = speculative_generate(model, heads, prompt, args.new_tokens, gamma=args.gamma,
                                                             draft_vocab=draft_vocab)
                    s_s += time.perf_counter() - t0
            if not torch.equal(outs["plain"], outs["spec"]):
                raise SmeltError(f"{lang} prompt {i}: speculative output differs from plain greedy (a bug)")
            acc.append(list(stats.accepted))
        n_tok = args.prompts * args.new_tokens
        per[lang] = _summary(acc, args.gamma, n_tok / p_s, n_tok / s_s)
        accepted_all += acc
        plain_s, spec_s = plain_s + p_s, spec_s + s_s
    tokens = len(langs) * args.prompts * args.new_tokens
    return per, _summary(accepted_all, args.gamma, tokens / plain_s, tokens / spec_s)


def _summary(per_prompt: list[list[int]], gamma: int, plain_tok_s: float, spec_tok_s: float) -> dict:
    """acceptance_summary over all rounds, alpha per prompt and its prompt-clustered standard error, speed."""
    rounds = [a for g in per_prompt for a in g]
    return {**acceptance_summary(rounds, gamma), "alpha_first_se": alpha_standard_error(per_prompt),
            "alpha_first_per_prompt": [acceptance_summary(g, gamma)["alpha_first"] for g in per_prompt],
            "plain_tok_s": plain_tok_s, "spec_tok_s": spec_tok_s, "speedup": spec_tok_s / plain_tok_s}


if __name__ == "__main__":
    run_cli(main)
