"""Hugging Face directory <-> our model: config.json + model.safetensors (+ tokenizer files).

Every artifact in the chain is a normal HF directory of its teacher's architecture (Llama, Mistral or
Qwen2: `ARCHITECTURES`), so `AutoModelForCausalLM.from_pretrained` can open any stage's output and any
checkpoint of those architectures can be a teacher. Only safetensors are
read; nothing is unpickled.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from core.dtensor import first_error, local, local_slices
from core.errors import SmeltError, one_line
from core.files import atomic_save_safetensors, check_finite, open_safetensors, read_json, read_safetensors
from core.hf_names import from_hf_name, layer_index, to_hf_name
from core.tokenizer import load_tokenizer  # noqa: F401 - where the stages import it from
from models.llama import LlamaConfig, Transformer


ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def config_to_hf(cfg: LlamaConfig, n_layers: int | None = None) -> dict:
    """config.json for `cfg` as its own architecture (model_type), so transformers and vLLM build exactly it."""
    layers = n_layers if n_layers is not None else cfg.n_layers
    if cfg.model_type not in ARCHITECTURES:
        raise SmeltError(f"model_type={cfg.model_type!r} is not one of {', '.join(ARCHITECTURES)}")
    if cfg.qkv_bias != (cfg.model_type == "qwen2"):
        raise SmeltError(f"model_type={cfg.model_type!r} cannot express qkv_bias={cfg.qkv_bias}")
    if cfg.sliding_window is not None and cfg.model_type != "mistral":
        raise SmeltError(f"model_type={cfg.model_type!r} cannot express a model-wide sliding_window")
    per_type = {
        "llama": {"attention_bias": False, "mlp_bias": False},
        "mistral": {"sliding_window": cfg.sliding_window},
        "qwen2": {"use_sliding_window": False, "sliding_window": None, "max_window_layers": layers},
    }[cfg.model_type]
    return {
        "architectures": [ARCHITECTURES[cfg.model_type]],
        "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        # Both spellings: transformers >= 5 reads rope_parameters, older readers (and vLLM) rope_theta.
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "llama3" if cfg.rope_scaling else "default", "rope_theta": cfg.rope_theta,
                            **(cfg.rope_scaling or {})},
        **({"rope_scaling": {"rope_type": "llama3", **cfg.rope_scaling}} if cfg.rope_scaling else {}),
        "tie_word_embeddings": cfg.tie_embeddings,
        **per_type,
        "bos_token_id": cfg.bos_id,
        "eos_token_id": cfg.eos_id,
        "torch_dtype": "float32",
    }


def _sliding_window(d: dict, model_type: str) -> int | None:
    """Mistral's model-wide window (None: full causal attention); Qwen2's per-layer windows are refused."""
    if model_type == "qwen2":
        if d.get("use_sliding_window"):
            raise SmeltError("config.json: use_sliding_window=true (Qwen2's per-layer sliding window) is not supported")
    elif model_type == "mistral":
        window = d.get("sliding_window")
        if window is not None and (not isinstance(window, int) or window < 1):
            raise SmeltError(f"config.json: sliding_window={window!r} is not a positive integer")
        return window
    types = set(d.get("layer_types") or ["full_attention"])
    if types != {"full_attention"}:
        raise SmeltError(f"config.json: layer_types {sorted(types)} are not supported (full_attention only)")
    return None


def config_from_hf(d: dict) -> LlamaConfig:
    """Our config from a Llama, Mistral or Qwen2 config.json; anything the model would compute differently
    (biases, another activation or RoPE, per-layer windows) is refused naming the field."""
    arch = (d.get("architectures") or ["?"])[0]
    model_type = d.get("model_type") or ("llama" if arch == "LlamaForCausalLM" else None)
    if model_type not in ARCHITECTURES:
        raise SmeltError(f"config.json model_type={d.get('model_type')!r} is not a Llama-family model "
                         f"({', '.join(ARCHITECTURES)})")
    if d.get("mlp_bias"):
        raise SmeltError("config.json: mlp_bias=true is not supported by models.llama")
    if d.get("attention_bias") and model_type != "qwen2":  # Llama's puts one on o_proj too
        raise SmeltError("config.json: attention_bias=true is not supported by models.llama (q/k/v biases: qwen2)")
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise SmeltError(f"config.json: hidden_act={act!r} is not supported (silu)")
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                           "intermediate_size") if k not in d]
    if missing:
        raise SmeltError(f"config.json has no {missing[0]!r}")
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise SmeltError(f"config.json: rope_type={rope_type!r} is not supported (default, llama3)")
    scaling = None
    if rope_type == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [k for k in keys if k not in rope]
        if missing:
            raise SmeltError(f"config.json: llama3 rope scaling lacks {', '.join(missing)}")
        scaling = {k: rope[k] for k in keys}
    theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
    eos = d.get("eos_token_id")
    return LlamaConfig(
        dim=d["hidden_size"], n_layers=d["num_hidden_layers"], n_heads=d["num_attention_heads"],
        n_kv_heads=d.get("num_key_value_heads") or d["num_attention_heads"], vocab_size=d["vocab_size"],
        ffn_hidden=d["intermediate_size"], head_dim=d.get("head_dim"), norm_eps=d.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta), rope_scaling=scaling,
        max_seq_len=d.get("max_position_embeddings", 2048),
        tie_embeddings=bool(d.get("tie_word_embeddings", False)), bos_id=d.get("bos_token_id"),
        eos_id=eos[0] if isinstance(eos, list) else eos, qkv_bias=model_type == "qwen2",
        sliding_window=_sliding_window(d, model_type), model_type=model_type,
    )


def hf_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """Our weights under HF names, layers renumbered 0..n-1 in order, tied lm_head omitted."""
    index = layer_index(model)
    out = {}
    for name, t in model.state_dict().items():
        if name == "output.weight" and model.cfg.tie_embeddings:
            continue
        out[to_hf_name(name, index)] = t.detach().contiguous()
    return out


def write_config(cfg: LlamaConfig, n_layers: int, out_dir: str | Path, dtype: torch.dtype | None = None,
                 extra: dict | None = None) -> None:
    """config.json for a model of `n_layers` blocks (fewer than cfg's after depth pruning)."""
    hf = config_to_hf(cfg, n_layers=n_layers)
    if dtype is not None:
        hf["torch_dtype"] = str(dtype).removeprefix("torch.")
    hf.update(extra or {})
    (Path(out_dir) / "config.json").write_text(json.dumps(hf, indent=2) + "\n")


def save_hf(model: Transformer, out_dir: str | Path, tokenizer=None, dtype: torch.dtype | None = None,
            extra_config: dict | None = None) -> None:
    """Write config.json, model.safetensors and tokenizer files into an existing directory."""
    out_dir = Path(out_dir)
    sd = hf_state_dict(model)
    if dtype is not None:
        sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}
    atomic_save_safetensors(sd, out_dir / "model.safetensors", metadata={"format": "pt"})
    write_config(model.cfg, len(model.layers), out_dir, dtype, extra_config)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out_dir))


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The weight files of an HF directory: model.safetensors, or the shards its index lists."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    if list(model_dir.glob("*.bin")) or list(model_dir.glob("*.pt")):
        raise SmeltError(f"{model_dir} holds only pickle weights (.bin/.pt); smelt loads safetensors only")
    raise SmeltError(f"{model_dir} has no model.safetensors")


def read_hf_tensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory under its HF name, as stored (checked readable and finite)."""
    state = {}
    for f in safetensors_files(model_dir):
        state.update(read_safetensors(f))
    return state


def read_hf_config(model_dir: str | Path) -> dict:
    return read_json(Path(model_dir) / "config.json", "a Hugging Face model directory")


def checkpoint_index(model_dir: Path, cfg: LlamaConfig) -> dict[str, tuple[Path, str]]:
    """{our name: (file, HF name)} from the safetensors headers, every name and shape checked against cfg.
    No tensor data is read here."""
    with torch.device("meta"):
        expected = Transformer(cfg).state_dict()
    if cfg.tie_embeddings:
        expected.pop("output.weight")
    index: dict[str, tuple[Path, str]] = {}
    for f in safetensors_files(model_dir):
        with open_safetensors(f) as st:
            names = st.keys()  # a safe_open handle, not a dict
            for hf_name in names:
                if hf_name.endswith("rotary_emb.inv_freq") or (cfg.tie_embeddings and hf_name == "lm_head.weight"):
                    continue
                name = from_hf_name(hf_name)
                if name not in expected:
                    raise SmeltError(f"{f.name}: tensor {hf_name} has no place in the model "
                                     f"(config.json says {cfg.n_layers} layers)")
                shape = tuple(st.get_slice(hf_name).get_shape())
                if shape != tuple(expected[name].shape):
                    raise SmeltError(f"{f.name}: {hf_name} has shape {shape}, config.json implies "
                                     f"{tuple(expected[name].shape)}")
                index[name] = (f, hf_name)
    missing = sorted(set(expected) - set(index))
    if missing:
        raise SmeltError(f"{model_dir}: checkpoint is missing {missing[0]}"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    return index


@torch.no_grad()
def load_into(model: Transformer, model_dir: str | Path) -> None:
    """Fill a materialised model, plain or FSDP2-sharded, from an HF directory, in the model's dtypes.

    Each parameter's local part is read as a safetensors slice, so a rank reads its own shards and never
    the whole model (peak memory per rank shrinks with the rank count). A NaN/inf weight or a truncated
    file is refused naming it, on every rank at once (a collective when distributed).
    """
    model_dir = Path(model_dir)
    index = checkpoint_index(model_dir, model.cfg)
    # A tied output head is the embedding: loaded once. Parameters no checkpoint holds (QAT's learned scales)
    # are someone else's to fill; every checkpoint tensor must find its parameter.
    params = {n: p for n, p in model.named_parameters() if n in index}
    missing = sorted(set(index) - set(params) - ({"output.weight"} if model.cfg.tie_embeddings else set()))
    if missing:
        raise SmeltError(f"{model_dir}: {index[missing[0]][1]} has no parameter in the model it is loaded into")
    by_file: dict[Path, list[str]] = {}
    for name in params:
        by_file.setdefault(index[name][0], []).append(name)
    error = None
    try:
        for f, names in by_file.items():
            with open_safetensors(f) as st:
                for name in names:
                    dst = local(params[name])
                    if dst.numel() == 0:  # an uneven shard can be empty on the last ranks
                        continue
                    t = st.get_slice(index[name][1])[local_slices(params[name])]
                    check_finite(index[name][1], t, f)
                    dst.copy_(t.to(dst.dtype))
    except Exception as e:  # noqa: BLE001 - any failure, agreed by every rank, else the others hang
        error = one_line(e) if isinstance(e, SmeltError) else f"{model_dir}: {type(e).__name__}: {one_line(e)}"
    error = first_error(error)
    if error:
        raise SmeltError(error)


def load_hf(model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Transformer:
    """Build our model from an HF Llama directory; every tensor's shape is checked by name."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise SmeltError(f"model directory {model_dir} does not exist")
    cfg = config_from_hf(read_hf_config(model_dir))
    with torch.device("meta"):
        model = Transformer(cfg).to(dtype)
    model = model.to_empty(device=device)
    if cfg.tie_embeddings:  # to_empty gives each module its own new parameter
        model.output.weight = model.tok_embeddings.weight
    load_into(model, model_dir)
    model.init_rope(device)
    return model
