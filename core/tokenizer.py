"""A model directory's tokenizer (every stage and the recipe's plan read text through it)."""
from __future__ import annotations

from pathlib import Path

from core.errors import SmeltError
from core.files import read_json


def load_tokenizer(model_dir: str | Path):
    """The directory's tokenizer. One that declares no BOS token (Qwen2's) gets its config.json's bos_token_id
    (Qwen2: <|endoftext|>, the separator its pretraining documents start after): every window starts with it."""
    from transformers import AutoTokenizer  # slow to import (seconds); only tokenizer loading needs it

    model_dir = Path(model_dir)
    if not (model_dir / "tokenizer.json").is_file() and not (model_dir / "tokenizer_config.json").is_file():
        raise SmeltError(f"{model_dir} has no tokenizer files (tokenizer.json)")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if tokenizer.bos_token_id is None and (model_dir / "config.json").is_file():
        bos = read_json(model_dir / "config.json", "a Hugging Face model directory").get("bos_token_id")
        if isinstance(bos, int) and 0 <= bos < len(tokenizer):
            tokenizer.bos_token = tokenizer.convert_ids_to_tokens(bos)
    return tokenizer
