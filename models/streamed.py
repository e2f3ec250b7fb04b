"""A model that calibrates from its checkpoint one block at a time, for models larger than memory.

StreamedModel builds the model on the meta device and reads a block's weights from the memory-mapped
safetensors only when the calibration engine reaches it (`load`); when the engine is done with the
block, `release` appends its final weights to the output's model.safetensors (core.safetensors_stream)
and drops them. Only the current block's weights, the calibration activations and the block's
statistics are ever held; the embedding is read once, to embed the windows, and copied to the output
in row chunks. core.calibrate.run_blocks drives it (`stream=`); `footprint` is what that holds.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch import nn

from core.device import release_memory, return_freed_memory_at_once
from core.errors import SmeltError
from core.files import check_finite, open_safetensors
from core.hf_names import from_hf_name, to_hf_name
from core.safetensors_stream import StreamedSafetensors
from core.sidefiles import closed_at_end
from models.hf_io import checkpoint_index, config_from_hf, read_hf_config, write_config
from models.llama import LlamaConfig, Transformer

COPY_ROWS = 4096  # rows per chunk when an untouched tensor is copied to the output


class StreamedModel:
    def __init__(self, model_dir: str | Path, device: str | torch.device = "cpu"):
        self.dir = Path(model_dir)
        if not self.dir.is_dir():
            raise SmeltError(f"model directory {self.dir} does not exist")
        cfg = config_from_hf(read_hf_config(self.dir))
        with torch.device("meta"):
            self.model = Transformer(cfg)
        self.index = checkpoint_index(self.dir, cfg)  # every name and shape checked; no data read
        return_freed_memory_at_once()
        self.device = torch.device(device)
        self.model.init_rope(self.device)
        self._out: StreamedSafetensors | None = None
        self._out_dir: Path | None = None

    @property
    def cfg(self) -> LlamaConfig:
        return self.model.cfg

    # ---- the engine's side ------------------------------------------------------------------------
    @torch.no_grad()
    def load(self, name: str, module: nn.Module) -> None:
        """Materialise `module` (our name `name`: "tok_embeddings", "layers.K") from the checkpoint: each
        tensor read becomes the parameter itself (no second copy: the embedding is the largest tensor)."""
        with contextlib.ExitStack() as files:
            handles = {}  # each checkpoint file opened once per module
            for pname, p in list(module.named_parameters()):
                f, hf = self.index[f"{name}.{pname}"]
                if f not in handles:
                    handles[f] = files.enter_context(open_safetensors(f))
                t = handles[f].get_tensor(hf)
                check_finite(hf, t, f)
                owner, _, leaf = pname.rpartition(".")
                sub = module.get_submodule(owner) if owner else module
                sub._parameters[leaf] = nn.Parameter(t.to(self.device, p.dtype), requires_grad=p.requires_grad)

    def release(self, name: str, module: nn.Module) -> None:
        """Done with `module`: a block's final weights go to the output (when one is open), then it is freed."""
        if self._out is not None and name.startswith("layers."):
            for pname, p in module.state_dict().items():
                self._out.write(to_hf_name(f"{name}.{pname}"), p.detach().float())
        module.to("meta")
        release_memory()  # glibc keeps freed blocks otherwise, and RSS would grow to the whole model

    # ---- the output artifact ----------------------------------------------------------------------
    def _output_names(self) -> list[str]:
        """model.safetensors' order: the embedding (copied first), the blocks as released, the rest."""
        names = [n for n in self.model.state_dict() if not (self.cfg.tie_embeddings and n == "output.weight")]
        return sorted(names, key=lambda n: 0 if n.startswith("tok_embeddings.") else 1 if n.startswith("layers.") else 2)

    def open_output(self, out_dir: str | Path) -> None:
        """Start out_dir/model.safetensors (fp32, as load_hf's model is saved) with the untouched embedding;
        blocks follow as they are released, the rest at close_output."""
        self._out_dir = Path(out_dir)
        shapes = self.model.state_dict()
        layout = [(to_hf_name(n), torch.float32, tuple(shapes[n].shape)) for n in self._output_names()]
        self._out = StreamedSafetensors(self._out_dir / "model.safetensors", layout, {"format": "pt"})
        while self._out.pending and not self._out.pending.startswith("model.layers."):
            self._copy(self._out.pending)

    def _copy(self, hf_name: str) -> None:
        """An untouched tensor, source to output in row chunks (never whole in memory)."""
        f, src = self.index[from_hf_name(hf_name)]
        with open_safetensors(f) as st:
            sl = st.get_slice(src)
            rows = sl.get_shape()[0]
            for a in range(0, rows, COPY_ROWS):
                t = sl[a:min(a + COPY_ROWS, rows)]
                check_finite(src, t, f)
                self._out.write(hf_name, t.float(), part=True)

    def close_output(self) -> None:
        """The tensors after the blocks, the file renamed into place, config.json."""
        while self._out.pending is not None:
            if self._out.pending.startswith("model.layers."):
                self._out.abort()
                raise SmeltError(f"the output is closed before block tensor {self._out.pending} was released")
            self._copy(self._out.pending)
        self._out.close()
        self._out = None
        write_config(self.cfg, len(self.model.layers), self._out_dir)

    def abort_output(self) -> None:
        if self._out is not None:
            self._out.abort()
            self._out = None

    @contextlib.contextmanager
    def writing(self, out_dir: str | Path, *side_files):
        """open_output, and at the end close it and the side files being streamed alongside it (each with
        close/abort), or on an error abort them all: no partial file is left."""
        try:
            self.open_output(out_dir)
            with closed_at_end(*side_files):
                yield
                self.close_output()
        except BaseException:
            self.abort_output()
            raise


def blocks_in_order(model: nn.Module, stream: StreamedModel | None):
    """(prefix, block) in layer order for stages that need no forward pass; with a stream each block is loaded
    before it is handed out and released (written, freed) when the next one is asked for."""
    for key, block in model.layers.items():
        prefix = f"layers.{key}"
        if stream is not None:
            stream.load(prefix, block)
        yield prefix, block
        if stream is not None:
            stream.release(prefix, block)


def block_params(cfg: LlamaConfig) -> int:
    """Parameters of one transformer block (two norms, attention, SwiGLU MLP)."""
    d, q, kv = cfg.dim, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return 2 * d + 2 * d * q + 2 * d * kv + 3 * d * cfg.ffn_hidden


def linear_groups(cfg: LlamaConfig) -> list[tuple[int, int]]:
    """(input width, rows solved together) of a block's linears that share an input: q/k/v, wo, w1/w3, w2."""
    d, f, q, kv = cfg.dim, cfg.ffn_hidden, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return [(d, q + 2 * kv), (q, d), (d, 2 * f), (f, d)]


def footprint(cfg: LlamaConfig, n_windows: int, seq_len: int, batch_size: int, forward_bytes: int,
              hessian: bool, refit: str | None = None, true_sequential: bool = False) -> dict[str, int]:
    """Bytes a streamed calibration holds at its peak, by part (an estimate from the shapes; the interpreter
    and libraries come on top). Two phases: embedding the windows, then one block at a time."""
    d, f, h = cfg.dim, cfg.ffn_hidden, cfg.n_heads
    block = block_params(cfg) * (4 + (forward_bytes if forward_bytes != 4 else 0))  # fp32 + a forward copy
    activations = n_windows * seq_len * d * 4  # the current block's inputs (the fp32 residual stream)
    if refit == "teacher":  # the teacher's stream of activations next to the model's
        activations *= 2
    batch = batch_size * seq_len * (6 * d + 3 * f + h * seq_len) * 4  # one batch's temporaries
    if true_sequential:  # every batch parked at once: at wo (norm, q, k and v repeated, attention out: 5 d
        # per token in the forward dtype) or at w2 (h in fp32; its norm and the down input: d + f)
        batch += n_windows * seq_len * max(5 * d * forward_bytes, 4 * d + (d + f) * forward_bytes)
    groups = linear_groups(cfg)
    stats = sum(i * i * 12 if hessian else i * 8 for i, _ in groups)  # fp64 sums + H handed out in fp32
    if refit == "teacher":  # X_dᵀX: fp64 sums + one fp32 product
        stats += sum(i * i * 12 for i, _ in groups)
    # two fp64 [in, in] at a time (H and its factor, then the inverse and its factor: core.obs) and W copies
    solve = max(2 * i * i * 8 + 3 * r * i * 4 for i, r in groups) if hessian else 0
    if refit:  # prune.algorithms.masked_refit: H_d and eight [rows, in] fp32 iterates
        solve = max(solve, max(i * i * 4 + 8 * r * i * 4 for i, r in groups))
    embed = cfg.vocab_size * d * 4 + activations + batch
    per_block = block + activations + batch + stats + solve
    return {"total": max(embed, per_block), "embedding_phase": embed, "block_phase": per_block,
            "block_weights": block, "activations": activations, "batch_temporaries": batch,
            "statistics": stats, "solver": solve}


def check_memory(stream: StreamedModel, limit_gib: float, n_windows: int, seq_len: int, batch_size: int,
                 forward_dtype: torch.dtype, hessian: bool, refit: str | None = None,
                 true_sequential: bool = False) -> dict:
    """The streamed calibration's estimated footprint, refused (one line) when it exceeds the limit
    (--max-memory) or, on a GPU, the GPU's free memory; returns what a manifest records."""
    if not limit_gib > 0:
        raise SmeltError(f"--max-memory {limit_gib} must be a positive number of GiB")
    need = footprint(stream.cfg, n_windows, seq_len, batch_size, torch.empty((), dtype=forward_dtype).element_size(),
                     hessian, refit, true_sequential)
    if need["total"] > limit_gib * 2**30:
        parts = ", ".join(f"{k.replace('_', ' ')} {v / 2**30:.3f}" for k, v in need.items()
                          if k not in ("total", "embedding_phase", "block_phase"))
        raise SmeltError(f"--max-memory {limit_gib} GiB is less than the streamed calibration needs: "
                         f"{need['total'] / 2**30:.3f} GiB ({parts} GiB); raise it or use fewer --calib-windows")
    if stream.device.type == "cuda":  # the footprint lives on the GPU there: the limit alone does not bound it
        free = torch.cuda.mem_get_info(stream.device)[0]
        if need["total"] > free:
            raise SmeltError(f"--max-memory: the streamed calibration needs {need['total'] / 2**30:.3f} GiB on "
                             f"{stream.device}, which has {free / 2**30:.3f} GiB free; use fewer --calib-windows")
    return {"max_memory_gib": limit_gib, "footprint_gib": {k: round(v / 2**30, 4) for k, v in need.items()}}
