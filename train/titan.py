"""torchtitan 0.3.0 components around our model: model adapter, parallelize, tokenizer, data, loss.

torchtitan builds the model on the meta device, calls `parallelize` (FSDP2), materialises it with
`to_empty`, then `init_weights`, which here loads the student artifact's safetensors into the shards.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.loss import IGNORE_INDEX, BaseLoss
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.protocols.model import BaseModel
from torchtitan.tools.logging import logger

from core.errors import SmeltError
from core.teacher_topk import TeacherTopK, TopKCache
from core.text_source import PackedTextStream, TextSourceConfig
from distill.losses import DistillLoss, DistillLossConfig, hidden_divergence
from models.hf_io import config_from_hf, load_into, load_tokenizer, read_hf_config
from models.llama import LlamaConfig, Transformer
from models.mtp import MTP_FILE, MTPConfig, MTPHeads, load_mtp_into
from qat.fake_quant import FakeQuantConfig, FakeQuantLinear, init_scales, swap_to_fake_quant
from qat.qparams import load_qparams_into


class SmeltModel(BaseModel):
    """torchtitan BaseModel around models.llama.Transformer (kept as `.inner`)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseModel.Config):
        init_from: str = ""
        """HF artifact directory whose weights initialise the model (set from the trainer's --student)."""
        arch: dict = field(default_factory=dict)
        """models.llama.LlamaConfig fields; read from init_from's config.json when empty."""
        seed: int = 0
        """Random-init seed when init_from is empty (debug runs)."""
        fake_quant: FakeQuantConfig = field(default_factory=FakeQuantConfig)
        """QAT: fake-quantize the linears (qat.fake_quant.FakeQuantConfig); off unless enable=True."""
        mtp: MTPConfig = field(default_factory=MTPConfig)
        """MTP modules (models.mtp.MTPConfig) trained on the frozen main model (or jointly); depth 0: none."""

        def update_from_config(self, *, config, **kwargs) -> None:
            student = getattr(config, "student", "")
            if student:
                self.init_from = student
            if not self.arch:
                self.arch = config_from_hf(read_hf_config(self.init_from)).to_dict()
            self.arch["max_seq_len"] = max(self.arch.get("max_seq_len", 0), config.training.seq_len + 1)

        def get_nparams_and_flops(self, model, seq_len):
            cfg = LlamaConfig.from_dict(self.arch)
            n = sum(p.numel() for p in model.parameters())
            n_emb = cfg.vocab_size * cfg.dim
            attn = 12 * len(model.inner.layers) * cfg.n_heads * cfg.head_dim * seq_len
            return n, 6 * (n - (0 if cfg.tie_embeddings else n_emb)) + attn

    def __init__(self, config: Config):
        super().__init__()
        self.config = config
        self.inner = Transformer(LlamaConfig.from_dict(config.arch))
        fq = config.fake_quant
        if fq.enable:  # post-build module swap, before parallelize (FSDP2 sees the final modules)
            swap_to_fake_quant(self.inner, fq.spec, skip=fq.skip, learn_scale=fq.learn_scale)
        self.mtp = MTPHeads(self.inner.cfg, config.mtp.depth, config.mtp.fuse_layers) if config.mtp.depth else None
        if self.mtp is not None and not config.mtp.joint:
            self.inner.requires_grad_(False)  # the main model is frozen: only the MTP modules train

    def verify_module_protocol(self) -> None:
        return  # the inner model is plain nn.Module by design (one definition for every stage)

    @torch.no_grad()
    def init_weights(self, buffer_device=None, **kwargs) -> None:
        inner = self.inner
        if inner.cfg.tie_embeddings and inner.output.weight is not inner.tok_embeddings.weight:
            inner.output.weight = inner.tok_embeddings.weight  # to_empty without FSDP (one rank) unties them
        if self.config.init_from:
            load_into(self.inner, self.config.init_from)  # this rank's shards only
            self.inner.init_rope(buffer_device or self.inner.tok_embeddings.weight.device)
        else:
            self.inner.init_weights(buffer_device=buffer_device, seed=self.config.seed)
        # QAT: scales saved by a PTQ stage (GPTQ) are kept; otherwise they come from the weights.
        init_from = self.config.init_from
        if self.config.fake_quant.enable and not (init_from and load_qparams_into(self.inner, init_from)):
            init_scales(self.inner)
        if self.mtp is not None:  # an artifact's MTP modules (re-alignment after QAT), else a fresh start
            if init_from and (Path(init_from) / MTP_FILE).is_file():
                load_mtp_into(self.mtp, init_from)
            else:
                self.mtp.init_weights(seed=self.config.seed,
                                      trunk=self.inner if self.config.mtp.init == "last_block" else None)

    def init_states(self, *, buffer_device=None) -> None:
        self.init_weights(buffer_device=buffer_device)

    def forward(self, tokens: torch.Tensor, **kwargs):
        """Logits [B, T, V]; with MTP modules (main logits or None when the main model is frozen,
        [logits of module k: B, T - k, V], the frozen main model's logits as the KL target when
        mtp.target is "main", else None, [per-token feature nMSE of module k: B, T - k] when
        mtp.feature_weight > 0, else None)."""
        if self.mtp is None:
            return self.inner(tokens)
        cfg = self.config.mtp
        if cfg.joint:
            h0, x0 = self.mtp.level0(self.inner, tokens)
            main, own = self.inner.output(h0), None
        else:
            with torch.no_grad():  # frozen: no activations kept for a backward that never reaches it
                h0, x0 = self.mtp.level0(self.inner, tokens)
                main, own = None, self.inner.output(h0) if cfg.target == "main" else None
        if not cfg.feature_weight:
            return main, self.mtp(self.inner, x0, tokens), own, None
        logits, feats = self.mtp(self.inner, x0, tokens, features=True)
        nmse = [hidden_divergence("nmse", f, h0[:, k:k + f.shape[1]]) for k, f in enumerate(feats, start=1)]
        return main, logits, own, nmse


def fsdp_mesh(parallel_dims):
    return parallel_dims.get_mesh("fsdp" if parallel_dims.spmd_backend == "partial_dtensor" else "dp_shard")


def shard_model(module: torch.nn.Module, blocks, mesh, mp: MixedPrecisionPolicy, gloo: bool,
                forward_only: bool = False) -> None:
    """FSDP2: each block its own unit, then the root (embeddings, norm, head).

    Fake-quantized linears get their own unit gathering fp32 weights whatever the compute dtype: they
    quantize the fp32 master weight (the codes the export writes) and only the dequantized weight meets
    the bf16 activations. A bf16 gather would round the weights first and train other codes.
    forward_only (the frozen teacher): the root is resharded after each forward too; FSDP2 otherwise keeps
    it gathered until a backward that never comes (the embedding and head, whole, on every rank).
    """
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                cast_forward_inputs=False)
    for blk in blocks:
        if mp.param_dtype not in (None, torch.float32):
            for m in blk.modules():
                if isinstance(m, FakeQuantLinear):
                    fully_shard(m, mesh=mesh, mp_policy=fp32)
        fully_shard(blk, mesh=mesh, mp_policy=mp)
    fully_shard(module, mesh=mesh, mp_policy=mp, reshard_after_forward=True if forward_only else None)
    for m in module.modules():
        if isinstance(m, FSDPModule):
            # The loss is already a sum / global token count, so gradients are summed, not averaged.
            m.set_gradient_divide_factor(1.0)
            if gloo:  # gloo has no PREMUL_SUM/AVG reduce-scatter; plain SUM is exact here
                m.set_force_sum_reduction_for_comms(True)


def parallelize(model: SmeltModel, *, parallel_dims, training, parallelism, compile_config, ac_config,
                dump_folder):
    """Transforms in the order they apply: activation checkpointing, compile, FSDP2."""
    # Both keep module names unchanged (no wrapper modules), so masks, qparams, sharded loading and DCP keys
    # stay the same whichever is on.
    if ac_config is not None:  # full activation checkpointing (train.trainer.check_config refuses the others)
        model.inner.recompute_blocks = True
        logger.info("Activation checkpointing: every block is recomputed in backward")
    if compile_config.enable and "model" in compile_config.components:
        for blk in model.inner.layers.values():
            # In place (the same module). Not fullgraph: a QAT block holds nested FSDP2 units (fp32 linears).
            blk.compile(backend=compile_config.backend)
    if parallel_dims.fsdp_enabled:
        mp = MixedPrecisionPolicy(param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
                                  reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce])
        gloo = not torch.cuda.is_available()
        blocks = [*model.inner.layers.values(), *(m.block for m in (model.mtp.mtp if model.mtp is not None else []))]
        shard_model(model, blocks, fsdp_mesh(parallel_dims), mp, gloo)
        logger.info("Applied FSDP2 (%d blocks + root)", len(blocks))
    return model


class HFTokenizer(BaseTokenizer):
    """The teacher's Hugging Face tokenizer (from hf_assets_path), exposed to torchtitan."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config: Config, *, tokenizer_path: str | None = None):
        super().__init__()
        self.hf = load_tokenizer(tokenizer_path)
        self.eos_id = self.hf.eos_token_id
        self.bos_id = self.hf.bos_token_id

    def encode(self, text: str, **kw) -> list[int]:
        return self.hf(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids, **kw) -> str:
        return self.hf.decode(ids)

    def get_vocab_size(self) -> int:
        return len(self.hf)


TOPK_KEYS = ("teacher_topk_ids", "teacher_topk_logprobs", "teacher_topk_rest")  # batch keys of a cached teacher


def pop_teacher_topk(extra_kwargs: dict) -> TeacherTopK | None:
    """The cached teacher's batch (StreamDataLoader with a teacher_cache), taken out of the model's kwargs."""
    if TOPK_KEYS[0] not in extra_kwargs:
        return None
    return TeacherTopK(*(extra_kwargs.pop(k) for k in TOPK_KEYS))


class CachedWindows:
    """A teacher cache's windows for one rank, in the layout they were drawn (core.teacher_topk): call c
    of rank r reads windows c * world * b + r * b + [0, b), wrapping around at the cache's end."""

    def __init__(self, path: str, dp_rank: int, dp_world_size: int, local_batch: int):
        self.cache, self.rank, self.world, self.calls = TopKCache(path), dp_rank, dp_world_size, 0
        built = (self.cache.settings["ranks"], self.cache.settings["local_batch"])
        if built != (dp_world_size, local_batch) and dp_rank == 0:
            logger.warning("teacher cache %s was drawn for %d ranks x %d windows, this run reads %d x %d: the "
                           "same windows in another order than an uncached run's", path, *built, dp_world_size,
                           local_batch)

    def next_batch(self, b: int) -> tuple[torch.Tensor, TeacherTopK]:
        base = self.calls * self.world * b + self.rank * b
        self.calls += 1
        return self.cache.windows([(base + j) % self.cache.n_windows for j in range(b)])

    def _layout(self) -> dict:
        return {"teacher_cache": str(self.cache.path), "windows": self.cache.n_windows, "dp_world_size": self.world}

    def state_dict(self) -> dict:
        return {"teacher_cache_calls": self.calls, **self._layout()}

    def load_state_dict(self, state: dict) -> None:
        if "teacher_cache_calls" not in state:
            raise SmeltError("the checkpoint's data position is a text stream's, not a teacher cache's: resume "
                             "with the --dataloader.teacher_cache setting it was trained with")
        for key, value in self._layout().items():
            if state.get(key) != value:
                raise SmeltError(f"teacher cache state was saved with {key}={state.get(key)!r}, this run has "
                                 f"{value!r}; resume needs the same cache and data-parallel layout")
        self.calls = int(state["teacher_cache_calls"])


class StreamDataLoader(BaseDataLoader):
    """Packed BOS-led windows from a text source (core.text_source: project corpora, local files, or a hub
    dataset), streamed with `datasets`, split between data-parallel ranks, tokenized on the fly; or, with
    `teacher_cache`, the windows of a teacher top-k cache with the teacher's top-k alongside (no teacher
    forward in the step).

    The stream position is checkpointed (per-rank key so DCP keeps each rank's copy), so a resumed run
    continues at exactly the same sample.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config, TextSourceConfig):
        """core.text_source.TextSourceConfig's fields and checks (at parse time, so train.launch refuses a
        bad source before any rank starts), as torchtitan's `--dataloader.*` section."""
        teacher_cache: str = ""
        """A distill.teacher_cache directory built from this source and seed: train on its windows and its
        top-k teacher log-probs (train.trainer.check_config checks it against the run)."""

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer, seq_len: int,
                 local_batch_size: int, snapshot_every_n_steps=None):
        self.bs = local_batch_size
        if config.teacher_cache:
            self.stream = CachedWindows(config.teacher_cache, dp_rank, dp_world_size, local_batch_size)
        else:
            self.stream = PackedTextStream(config, tokenizer.hf, seq_len, dp_rank=dp_rank,
                                           dp_world_size=dp_world_size)
        self._key = f"dp_rank_{dp_rank}"

    def __iter__(self):
        while True:
            batch = self.stream.next_batch(self.bs)
            if isinstance(batch, tuple):
                tokens, t = batch
                yield dict(zip(("input", *TOPK_KEYS), (tokens[:, :-1], t.ids, t.logprobs, t.rest))), tokens[:, 1:]
            else:
                yield {"input": batch[:, :-1]}, batch[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        # One JSON string per rank: DCP loads into the current state's structure, and the stream's state
        # (shuffle buffer, datasets position) changes shape as it runs. JSON, not pickle: nothing to unpickle.
        return {self._key: json.dumps(self.stream.state_dict())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state and self._key in state:
            self.stream.load_state_dict(json.loads(state[self._key]))  # refuses another source or layout


class KDLoss(BaseLoss):
    """torchtitan loss contract (local sum / global valid tokens) around distill.losses.DistillLoss.

    With no teacher logits (a plain run) it is cross-entropy.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseLoss.Config, DistillLossConfig):
        """distill.losses.DistillLossConfig's fields and checks, as torchtitan's `--loss.*` section."""

    def __init__(self, config: Config, *, compile_config=None):
        self.inner = DistillLoss(config)

    def __call__(self, pred, labels, global_valid_tokens=None, *, teacher_logits=None, **kwargs):
        local_valid = (labels != IGNORE_INDEX).sum()
        if teacher_logits is None:
            ce = torch.nn.functional.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(),
                                                   ignore_index=IGNORE_INDEX, reduction="sum")
            loss_sum, metrics = ce, {"ce": ce.detach() / local_valid.clamp_min(1)}
        else:
            loss_mean, metrics = self.inner(pred, teacher_logits, labels)
            loss_sum = loss_mean * local_valid.clamp_min(1)
        denom = global_valid_tokens if global_valid_tokens is not None else local_valid.clamp_min(1)
        return loss_sum / denom, metrics
