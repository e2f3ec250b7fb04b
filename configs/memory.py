"""The numbers of a recipe's plan (configs.recipe --dry-run) and its text: model shapes from a config.json,
the training configs' budgets (read statically from train/config_registry.py), memory per rank.

The memory estimate is a sum of rows, each a formula of the shapes and the stage's budget (FORMULAS; the
plan prints them). It models the trainer as it is: FSDP2 over every rank (shard degree dp), fp32 master
weights, AdamW, compute copies in `training.mixed_precision_param` (fake-quantized linears gathered in
fp32), a KD teacher stored in the compute dtype and sharded like the student, the chunked KL loss of
distill.losses. It adds terms that peak at different moments of a step (gradients, activations, the loss)
and knows nothing of allocator slack: a planning number, not a guarantee.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from core.errors import SmeltError
from core.fetch import cache_root
from core.files import read_json
from core.kl import chunk_tokens

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
# What a rank holds before any tensor of ours: measured (peak RSS after importing train.trainer, CPU) and
# assumed (CUDA context + NCCL buffers, which torch's memory stats and torchtitan's `memory:` leave out).
RUNTIME_GIB = {"cpu": 0.8, "gpu": 1.0}
ROWS = ("parameters", "gradients", "optimizer", "compute copies", "activations", "teacher", "logits",
        "runtime")
REGISTRY = Path(__file__).resolve().parents[1] / "train" / "config_registry.py"


@dataclass(frozen=True)
class Shape:
    """A Llama-family decoder's sizes (models.llama's layout: SwiGLU MLP, GQA, RMSNorm)."""
    layers: int
    d_model: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    source: str = ""

    @property
    def block_linears(self) -> int:
        attn = self.d_model * self.head_dim * (2 * self.heads + 2 * self.kv_heads)  # wq, wo; wk, wv
        return attn + 3 * self.d_model * self.ffn  # SwiGLU w1 w2 w3

    @property
    def block_params(self) -> int:
        return self.block_linears + 2 * self.d_model  # + two RMSNorm gains

    @property
    def root_params(self) -> int:
        """FSDP2's root unit: embeddings, the final norm and the head (shared when tied)."""
        return self.vocab * self.d_model * (1 if self.tied else 2) + self.d_model

    @property
    def params(self) -> int:
        return self.layers * self.block_params + self.root_params


def read_shape(path: str | Path) -> Shape:
    """Shapes from an HF config.json (or a directory holding one). Read directly, not through
    models.hf_io (configs/ sits below models/), so any rope scaling (Llama 3.1's llama3) is fine here."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    d = read_json(path, "a Hugging Face model directory")
    try:
        heads, dim = int(d["num_attention_heads"]), int(d["hidden_size"])
        return Shape(layers=int(d["num_hidden_layers"]), d_model=dim, heads=heads,
                     kv_heads=int(d.get("num_key_value_heads") or heads),
                     head_dim=int(d.get("head_dim") or dim // heads), ffn=int(d["intermediate_size"]),
                     vocab=int(d["vocab_size"]), tied=bool(d.get("tie_word_embeddings", False)),
                     source=str(path))
    except KeyError as e:
        raise SmeltError(f"{path} has no {e.args[0]!r} (not a Llama-family config.json)") from None


def teacher_dir(spec: str) -> Path | None:
    """Where models.teacher puts a teacher, found without fetching (None: only running it can tell)."""
    p = Path(spec)
    if p.is_dir():
        return p
    return None if p.suffix == ".gguf" or "/" in spec else cache_root() / "teachers" / spec


def find_shape(teacher: str, teacher_config: str | None, override: str | None) -> Shape | None:
    """The shapes of: --teacher-config, else the teacher's own config.json when it is on this machine, else
    the recipe's teacher_config; None when there is none (a registered teacher not fetched yet)."""
    tdir = teacher_dir(teacher)
    if tdir is not None and (tdir / "config.json").is_file() and not override:
        return read_shape(tdir)
    return read_shape(override or teacher_config) if override or teacher_config else None


# What a registry line sets -> the budget key: `_config(steps=, batch=, seq_len=, dtype=)` keywords and
# `cfg.<section>.<field> = value` assignments.
_KEYS = {"steps": "steps", "batch": "local_batch", "seq_len": "seq_len", "dtype": "dtype",
         "source": "source", "training.steps": "steps", "training.local_batch_size": "local_batch",
         "training.global_batch_size": "global_batch", "training.seq_len": "seq_len",
         "training.mixed_precision_param": "dtype", "dataloader.source": "source",
         "activation_checkpoint": "activation_checkpoint", "model_spec.model.fake_quant": "fake_quant",
         "model_spec.model.mtp.fuse_layers": "fuse_layers"}


def read_registry(path: Path = REGISTRY) -> dict[str, dict]:
    """{config name: the budget it sets} from train/config_registry.py's source, read without importing
    it (configs/ may not import train/): steps, local_batch, global_batch, seq_len, dtype, source,
    activation_checkpoint, fake_quant, and an MTP config's fuse_layers where it sets them. A config built from
    another (`cfg = h100_recover()`) starts from its values. What cannot be read is absent, and the recipe must state it; tests/test_recipe.py checks
    every value against the real configs."""
    if not path.is_file():
        raise SmeltError(f"{path} does not exist (the training configs' registry)")
    tree = ast.parse(path.read_text(encoding="utf-8"))
    consts = {t.id: n.value for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
              if isinstance(t, ast.Name)}

    def value(key: str, node: ast.AST):
        if key == "activation_checkpoint":  # on when set to anything but None
            return not (isinstance(node, ast.Constant) and node.value is None)
        if key == "fake_quant":  # FakeQuantConfig(enable=True, ...)
            return any(k.arg == "enable" and value("", k.value) is True
                       for k in getattr(node, "keywords", []))
        try:
            return ast.literal_eval(consts.get(node.id, node) if isinstance(node, ast.Name) else node)
        except ValueError:
            return None

    def settings(body: list[ast.stmt], done: dict, builder: bool = False) -> dict:
        found = {}
        for stmt in body:  # in order: a later line overrides an earlier one
            for call in (n for n in ast.walk(stmt) if isinstance(n, ast.Call)):
                name = getattr(call.func, "id", "")
                found.update(done.get(name, {}))  # built from another config, or from _config
                # _config's own keywords; inside _config, those of the Config(...) calls it makes
                wanted = ("source", "activation_checkpoint") if builder else (
                    ("steps", "batch", "seq_len", "dtype") if name == "_config" else ())
                found.update({_KEYS[k.arg]: value(_KEYS[k.arg], k.value)
                              for k in call.keywords if k.arg in wanted})
            if isinstance(stmt, ast.Assign):
                target, val = stmt.targets[0], stmt.value
                tuples = isinstance(target, ast.Tuple) and isinstance(val, ast.Tuple)
                for t, v in zip(target.elts, val.elts) if tuples else [(target, val)]:
                    dotted = ast.unparse(t).split(".", 1)[-1] if isinstance(t, ast.Attribute) else ""
                    key = _KEYS.get(dotted)
                    if key:
                        found[key] = value(key, v)
        return found

    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    done: dict[str, dict] = {}
    if "_config" in funcs:
        f = funcs["_config"]
        defaults = {_KEYS[a.arg]: value("dtype", d) for a, d in zip(f.args.kwonlyargs, f.args.kw_defaults)
                    if a.arg == "dtype" and d is not None}
        done["_config"] = {"fake_quant": False, **defaults, **settings(f.body, {}, builder=True)}
    for name, f in funcs.items():  # in source order: a config uses only those defined above it
        if not name.startswith("_"):
            done[name] = {k: v for k, v in settings(f.body, done).items() if v is not None}
    return {k: v for k, v in done.items() if not k.startswith("_")}


@dataclass(frozen=True)
class Budget:
    """One training stage as one rank runs it (one micro-batch)."""
    kind: str              # recover | qat | mtp
    local_batch: int
    seq_len: int
    dtype: str             # training.mixed_precision_param: the dtype of the compute copies
    dp: int                # FSDP2 shard degree: every rank of every node
    device: str            # cpu | gpu
    activation_checkpoint: bool = False
    fake_quant: bool = False
    teacher_top_k: int = 0  # > 0: the teacher is a top-k cache (no teacher model, no teacher logits)


def act_bytes_per_token_layer(s: Shape, c: int) -> int:
    """Saved activations of one models.llama block per token, as torch.autograd.graph.saved_tensors_hooks
    counts them: the RMSNorm inputs (upcast to fp32), normalized and output (x2 norms), q, k and v after
    the GQA repeat, the attention output, and 4 ffn-wide SwiGLU tensors; plus logsumexp and rsqrt."""
    return (4 * s.d_model + 4 * s.heads * s.head_dim + 4 * s.ffn) * c + 2 * s.d_model * 4 + 4 * (s.heads + 2)


FORMULAS = {
    "parameters": "fp32 master weights, FSDP2-sharded: 4 B x params / dp (mtp: + the MTP module)",
    "gradients": "fp32, sharded: 4 B x trained params / dp",
    "optimizer": "AdamW exp_avg + exp_avg_sq, fp32, sharded: 8 B x trained params / dp",
    "compute copies": "all-gathered units (c B; fake-quantized linears 4 B): root (embeddings, head, norm) + "
                      "this block + the prefetched next; dp 1: bf16 autocast's cast cache of all weights",
    "activations": "tokens x layers x [(4 d + 4 heads x head_dim + 4 ffn) x c + 8 d + 4 (heads + 2)] B "
                   "(saved_tensors_hooks on models.llama's block) + the final norm; with activation "
                   "checkpointing: d x c per token per layer + one block; fake quantization (learned "
                   "scales) also keeps (8 + c) B per linear weight per block; mtp: one block",
    "teacher": "stored in c B, sharded: c x params / dp, + its root and one block gathered while it runs; "
               "a top-k cache instead: its batch, tokens x (6 k + 4) B",
    "logits": "student + teacher logits + dL/dlogits: 3 x tokens x vocab x c B, + the chunked KL's ~6 fp32 "
              "[chunk x vocab] arrays (chunk = min(1024, tokens); +2 upcasts when c = 2)",
    "runtime": "CPU: Python + torch + torchtitan + transformers, measured 0.8 GiB; GPU: CUDA context + NCCL, "
               "~1 GiB (outside torch's memory stats)",
}


def estimate(s: Shape, b: Budget) -> dict[str, float]:
    """Bytes per rank by row (ROWS), plus 'total'."""
    c = DTYPE_BYTES[b.dtype]
    tokens = b.local_batch * b.seq_len
    stored = trained = s.params
    layers = s.layers
    if b.kind == "mtp":  # one block + a 2d -> d projection on the frozen trunk, the embedding and head shared
        trained = s.block_params + 2 * s.d_model ** 2
        stored += trained
        layers = 1  # the trunk runs without grad; only the MTP block keeps activations
    kept = 1 if b.activation_checkpoint else layers  # blocks whose full activations are alive at once
    acts = tokens * kept * act_bytes_per_token_layer(s, c)
    if b.activation_checkpoint:
        acts += tokens * layers * s.d_model * c
    acts += tokens * (2 * s.d_model * c + 4 * s.d_model)  # final norm (fp32 input, normalized, output)
    if b.fake_quant:
        acts += kept * s.block_linears * (8 + c)
    block = 4 * s.block_linears + c * 2 * s.d_model if b.fake_quant else c * s.block_params
    copies = c * s.root_params + 2 * block if b.dp > 1 else (c * s.params if c < 4 else 0)
    chunk = min(chunk_tokens(b.device), tokens)  # the loss's chunk (distill.losses: by device)
    rows = {
        "parameters": 4 * stored / b.dp,
        "gradients": 4 * trained / b.dp,
        "optimizer": 8 * trained / b.dp,
        "compute copies": copies,
        "activations": acts,
        "teacher": (tokens * (6 * b.teacher_top_k + 4) if b.teacher_top_k else
                    c * s.params / b.dp + (c * (s.root_params + s.block_params) if b.dp > 1 else 0)),
        "logits": (3 - bool(b.teacher_top_k)) * tokens * s.vocab * c + (6 + (2 if c < 4 else 0)) * chunk * s.vocab * 4,
        "runtime": RUNTIME_GIB[b.device] * GIB,
    }
    rows["total"] = sum(rows.values())
    return rows


def format_plan(p: dict) -> str:
    """The plan (configs.recipe.plan's dict) as text: header, stages with commands, the memory table."""
    par, m = p["parallelism"], p["model"]
    unit = "GPU" if par["device"] == "gpu" else "CPU rank"
    lines = [f"recipe    {p['recipe']}",
             f"teacher   {p['teacher']} -> {p['teacher_dir'] or '(known when run)'}"]
    if m:
        lines.append(f"model     {m['layers']} layers, d_model {m['d_model']}, heads {m['heads']} / kv "
                     f"{m['kv_heads']} (head_dim {m['head_dim']}), ffn {m['ffn']}, vocab {m['vocab']}, "
                     f"{'tied' if m['tied'] else 'untied'}: {m['params']:,} parameters  [{m['source']}]")
    lines += [(f"parallel  {par['nodes']} node(s) x {par['nproc']} {unit}(s) = data-parallel {par['dp']} "
               "(FSDP2 shards over every rank)"), f"run dir   {p['run_dir']}", "", "stages"]
    for i, s in enumerate(p["stages"], 1):
        tokens = f"   {s['tokens_formula']} = {s['tokens']:,} tokens" if s["tokens"] else ""
        lines.append(f"{i:>3} {s['name']} [{s['kind']}]  {s['input'] or '-'} -> {s['output'] or '-'}{tokens}")
        if s.get("budget"):
            b = s["budget"]
            ac = "on" if b["activation_checkpoint"] else "off"
            lines.append(f"      config {b['config'] or '-'}: local batch {b['local_batch']}, global batch "
                         f"{b['global_batch']}, seq_len {b['seq_len']}, {b['dtype']}, activation "
                         f"checkpointing {ac}, source {b['source']}")
        if s.get("calibration"):
            c = s["calibration"]
            distinct = ("distinct tokens not counted" if c["distinct_tokens"] is None
                        else f"{c['distinct_tokens']:,} distinct corpus tokens")
            lines.append(f"      calibration {c['corpus']}, {c['sampling']} windows: {distinct} ({c['basis']})")
        lines += [f"      $ {c}" for c in s["commands"]] or ["      (not built yet: planned)"]
        lines += [f"      $ {s['evaluation']}"] if s["evaluation"] else []
    mem = [s for s in p["stages"] if "memory_gib" in s]
    if mem:
        lines += ["", f"memory per {unit}, GiB", f"  {'':<16}" + "".join(f"{s['name']:>12}" for s in mem)]
        lines += [f"  {row:<16}" + "".join(f"{s['memory_gib'][row]:>12.2f}" for s in mem)
                  for row in (*ROWS, "total")]
        lines += ["", "formulas (d = d_model, c = compute dtype bytes, dp = data-parallel degree)"]
        lines += [f"  {k}: {v}" for k, v in FORMULAS.items()]
    return "\n".join(lines + [f"note: {n}" for n in p["notes"]])
