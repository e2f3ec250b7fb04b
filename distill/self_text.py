"""Text the main model writes itself: a training source for its MTP modules (self-distillation data).

    python -m distill.self_text --model runs/smollm2/recovered-2of4 --prompts 512 --prompt-len 32 \\
        --new-tokens 224 --out runs/smollm2/self-text
    torchrun ... -m train.run --config smollm2_mtp_main ... --dataloader.source runs/smollm2/self-text/text.jsonl

Speculative decoding accepts a draft when it is what the main model itself would produce, on the text the
main model itself is producing; that text is this file (the self-distillation data of Medusa-2 and EAGLE).
Prompts are seeded windows of training corpora (never evaluation text: core.data.calibration_windows),
continued in batches with the KV cache, greedily by default (what greedy acceptance is measured on) or
sampled (`--temperature`); a row ends at the tokenizer's end-of-sequence token. `text.jsonl` holds one
{"text": prompt + continuation} per row; `manifest.json` names the model (fingerprint), the settings and
the command. The output directory is written whole or not at all.
"""
from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from core.artifact import weights_fingerprint, write_manifest
from core.data import SelfTextConfig, calibration_windows, corpus_record
from core.device import default_device, machine_record
from core.errors import ArgumentParser, SmeltError, run_cli
from core.files import atomic_dir
from core.text_source import SELF_TEXT_FILE
from models.generate import sample
from models.hf_io import load_hf, load_tokenizer
from models.teacher import DEFAULT_TEACHER, resolve_teacher

STAGE = "self_text"


@torch.no_grad()
def continue_prompts(model, prompts: torch.Tensor, new_tokens: int, temperature: float, batch_size: int,
                     seed: int) -> torch.Tensor:
    """[n, P] prompts -> [n, P + new_tokens]: each batch continued with the KV cache (seeded sampling)."""
    device = model.tok_embeddings.weight.device
    gen = torch.Generator(device=device).manual_seed(seed)
    rows = [sample(model, b.to(device), new_tokens, temperature=temperature, generator=gen).cpu()
            for b in tqdm(prompts.split(batch_size), desc="self text", unit="batch")]
    return torch.cat(rows)


def decode_rows(tokenizer, rows: torch.Tensor, prompt_len: int) -> list[str]:
    """Each row as text: BOS and special tokens dropped, cut at the first end-of-sequence token the model
    wrote (the prompt's own text is kept whole)."""
    eos = tokenizer.eos_token_id
    texts = []
    for row in rows.tolist():
        new = row[prompt_len:]
        if eos is not None and eos in new:
            new = new[:new.index(eos)]
        texts.append(tokenizer.decode(row[:prompt_len] + new, skip_special_tokens=True))
    return texts


def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(prog="python -m distill.self_text", description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="the main model (HF artifact directory) that writes the text")
    ap.add_argument("--teacher", default=DEFAULT_TEACHER, help="tokenizer source when the model has none")
    d = SelfTextConfig  # the defaults and the checks (core.data)
    ap.add_argument("--corpus", default=d.corpus,
                    help="training corpora the prompts come from (a '+'-joined mix, split evenly)")
    ap.add_argument("--prompts", type=int, default=d.prompts, help="rows to write")
    ap.add_argument("--prompt-len", type=int, default=d.prompt_len, help="prompt tokens per row (BOS included)")
    ap.add_argument("--new-tokens", type=int, default=d.new_tokens, help="tokens the model writes per row")
    ap.add_argument("--temperature", type=float, default=d.temperature, help="0: greedy (default), else sampled")
    ap.add_argument("--seed", type=int, default=d.seed, help="prompt offsets and sampling")
    ap.add_argument("--batch-size", type=int, default=d.batch_size, help="rows continued together")
    ap.add_argument("--out", required=True, help="output directory (text.jsonl + manifest.json; must not exist)")
    args = ap.parse_args(argv)
    cfg = SelfTextConfig(corpus=args.corpus, prompts=args.prompts, prompt_len=args.prompt_len,
                         new_tokens=args.new_tokens, batch_size=args.batch_size, temperature=args.temperature,
                         seed=args.seed)
    if Path(args.out).exists():
        raise SmeltError(f"--out {args.out} already exists; remove it first")
    model = load_hf(args.model, device=str(default_device())).eval()
    if cfg.prompt_len + cfg.new_tokens > model.cfg.max_seq_len:
        raise SmeltError(f"--prompt-len {cfg.prompt_len} + --new-tokens {cfg.new_tokens} exceeds the model's "
                         f"max_seq_len={model.cfg.max_seq_len}")
    tok_dir = args.model if (Path(args.model) / "tokenizer.json").is_file() else resolve_teacher(args.teacher)
    tokenizer = load_tokenizer(tok_dir)
    prompts = calibration_windows(tokenizer, cfg.prompts, cfg.prompt_len, cfg.seed, cfg.corpus)
    t0 = time.perf_counter()
    rows = continue_prompts(model, prompts, cfg.new_tokens, cfg.temperature, cfg.batch_size, cfg.seed)
    seconds = time.perf_counter() - t0
    texts = decode_rows(tokenizer, rows, cfg.prompt_len)
    with atomic_dir(args.out) as tmp:
        (tmp / SELF_TEXT_FILE).write_text(
            "".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts), encoding="utf-8")
        write_manifest(tmp, stage=STAGE, settings={
            "model": str(args.model), "model_fingerprint": weights_fingerprint(args.model),
            "corpus": cfg.corpus, "corpora": corpus_record(cfg.corpus), "prompts": cfg.prompts,
            "prompt_len": cfg.prompt_len, "new_tokens": cfg.new_tokens, "temperature": cfg.temperature,
            "seed": cfg.seed, "command": shlex.join(["python", "-m", "distill.self_text",
                                                      *(sys.argv[1:] if argv is None else argv)])},
            metrics={"generated_tokens": cfg.generated_tokens, "seconds": seconds,
                     "machine": machine_record()})
    print(f"{args.out}/{SELF_TEXT_FILE}: {len(texts)} rows, {cfg.generated_tokens} generated tokens in "
          f"{seconds:.0f} s")


if __name__ == "__main__":
    run_cli(main)
