"""SmeltTrainer: torchtitan's Trainer plus a frozen teacher, fixed sparsity masks, fault handling, export.

- Teacher: the model before compression, full precision, frozen. It is a plain attribute (not in
  model_parts), so it is not in the optimizer, not clipped and not in the checkpoint; it is sharded with
  FSDP2 like the student so a large teacher fits.
- Masks: masks.safetensors of the student artifact become a MaskSet; gradients of removed weights are
  zeroed after every backward and the weights re-masked after every optimizer step, or, with
  `--mask_learning.mode srste` or `maskllm`, the masks keep learning until a freeze step (train.masks).
- Cached teacher (`--dataloader.teacher_cache DIR`, distill.teacher_cache): the windows and the teacher's
  top-k log-probs come from the cache, no teacher is built or run, and the loss is the top-k KL
  (distill.losses.topk_forward_kl); check_config holds the cache to the run's settings.
- On-policy steps (`--on_policy.share`, train.on_policy): a share of the steps train on windows the
  student continued itself from the data's first tokens, scored by the teacher (GKD).
- Layer-wise targets (`--loss.hidden_weight`, `--loss.hidden_layers`): forward hooks keep the listed
  blocks' outputs of student and teacher (blocks paired through train.lineage after depth removal), and
  distill.losses.hidden_divergence adds their distance to the loss.
- Faults: SIGTERM/SIGUSR1 (or the file $SMELT_STOP_FILE, which slurm/task.sh touches) -> checkpoint after
  the current step, exit 0 (Slurm preemption/time-out);
  a NaN/inf loss or gradient stops before the optimizer step, so the last checkpoint stays good.
- Export: at the last step the student is gathered and written as an HF artifact (+ masks, manifest).
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path

import spmd_types as spmd
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed.activation_checkpoint import FullAC
from torchtitan.distributed.utils import set_pg_timeouts
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from core.device import peak_rss_gib
from core.dtensor import full, local
from core.errors import SmeltError
from core.files import atomic_write_text
from core.masks import MASKS_FILE, MasksOnDisk, load_dense_rows
from core.runlock import RunLock
from core.teacher_topk import TopKCache
from distill.losses import hidden_divergence
from models.hf_io import config_from_hf, load_into, read_hf_config
from models.llama import Transformer
from models.teacher import resolve_teacher
from train.checks import check_teacher_cache, hidden_pairs
from train.export import EXPORT_INFO, EXPORT_INFO_FORMAT, empty_cpu_copy, gather, write_from_info
from train.masks import MaskLearningConfig, MaskSet
from train.on_policy import OnPolicyConfig, student_windows
from train.titan import fsdp_mesh, pop_teacher_topk, shard_model


class TrainingStopped(SmeltError):
    """Training cannot continue (non-finite loss or gradient); the message names the step (one line, exit 2)."""


def check_config(config: SmeltTrainer.Config) -> None:
    """The checks that need no model or process group (train.launch runs them before the ranks start)."""
    if not config.student or not Path(config.student).is_dir():
        raise SmeltError(f"--student {config.student!r}: artifact directory does not exist")
    if config.export_timeout_seconds <= 0:
        raise SmeltError(f"--export_timeout_seconds must be > 0, got {config.export_timeout_seconds}")
    if config.activation_checkpoint is not None and not isinstance(config.activation_checkpoint, FullAC.Config):
        policy = type(config.activation_checkpoint).__qualname__.split(".")[0]
        raise SmeltError(f"activation checkpointing policy {policy} is not supported: use "
                         f"activation_checkpoint:full or activation_checkpoint:none")
    if config.teacher:
        try:
            resolve_teacher(config.teacher, download=False)
        except SmeltError as e:
            raise SmeltError(f"--teacher: {e}") from None
    if config.mask_learning.mode != "fixed":
        what = f"--mask_learning.mode {config.mask_learning.mode}"
        if not (Path(config.student) / MASKS_FILE).is_file():
            raise SmeltError(f"{what}: --student {config.student} has no {MASKS_FILE} to start from")
        model = config.model_spec.model
        if model.fake_quant.enable or model.mtp.depth:
            raise SmeltError(f"{what} is for recovery: QAT and MTP stages keep the masks they are given")
        if config.mask_learning.mode == "maskllm" and (not config.teacher or config.dataloader.teacher_cache):
            raise SmeltError(f"{what} needs a --teacher model (its dense weights start the pruned latents; a "
                             f"teacher cache holds none)")
    if config.dataloader.teacher_cache:
        if config.model_spec.model.mtp.depth and config.model_spec.model.mtp.target == "main":
            raise SmeltError(f"--dataloader.teacher_cache {config.dataloader.teacher_cache}: mtp.target main "
                             f"distils to the main model itself, not to a cached teacher")
        check_teacher_cache(config)
    if config.loss.hidden_keys or config.loss.hidden_weight:
        hidden_pairs(config)
    if config.on_policy.share > 0:
        what, model = f"--on_policy.share {config.on_policy.share}", config.model_spec.model
        if not config.teacher or config.dataloader.teacher_cache:
            raise SmeltError(f"{what} needs a --teacher to score the student's text (a teacher cache holds "
                             f"only the data's windows)")
        if model.fake_quant.enable or model.mtp.depth:
            raise SmeltError(f"{what} is for recovery: QAT and MTP stages train on the data's windows")
        if config.loss.ce_weight > 0:
            raise SmeltError(f"{what}: --loss.ce_weight {config.loss.ce_weight} would train the student on its "
                             f"own samples as targets; on-policy steps learn from the teacher's KL only")
        if config.on_policy.prompt_tokens >= config.training.seq_len + 1:
            raise SmeltError(f"--on_policy.prompt_tokens={config.on_policy.prompt_tokens} leaves nothing to "
                             f"sample in {config.training.seq_len + 1}-token windows (--training.seq_len + 1)")
    ck = config.checkpoint
    if ck.enable and ck.load_step > 0:
        step_dir = Path(config.dump_folder) / ck.folder / f"step-{ck.load_step}"
        if not (step_dir / ".metadata").is_file():
            raise SmeltError(f"--checkpoint.load_step {ck.load_step}: no checkpoint at {step_dir}")


def _token_mean(per_token: torch.Tensor, labels: torch.Tensor, global_valid_tokens
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """A per-token term [B, T] as a loss part (its sum over valid tokens / the global token count, as the
    trainer's losses are normalised) and, detached, its mean over this micro-batch's valid tokens (a metric)."""
    valid = (labels != -100).float()
    total = (per_token * valid).sum()
    denom = global_valid_tokens if global_valid_tokens is not None else valid.sum().clamp_min(1)
    return total / denom, (total / valid.sum().clamp_min(1)).detach()


class SmeltTrainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        student: str = ""
        """Artifact directory (HF layout) holding the student's starting weights and optional masks."""
        teacher: str = ""
        """Teacher HF directory, .gguf or registered name. Empty: plain next-token cross-entropy, or the
        teacher a --dataloader.teacher_cache was built from (then only checked against it)."""
        export_dir: str = ""
        """Write the trained student here (HF layout + masks + manifest) after the last step."""
        save_on_signal: bool = True
        """Checkpoint and exit cleanly on SIGTERM / SIGUSR1."""
        mask_learning: MaskLearningConfig = field(default_factory=MaskLearningConfig)
        """Fixed masks (default) or masks re-selected during training (SR-STE; train.masks)."""
        on_policy: OnPolicyConfig = field(default_factory=OnPolicyConfig)
        """A share of the steps on the student's own continuations, scored by the teacher (train.on_policy)."""
        export_timeout_seconds: int = 3600
        """Collective timeout while ranks wait on a checkpoint save or on rank 0's export (gather, write,
        hashes): torchtitan's comm.train_timeout_seconds is shorter than an 8B model's export."""

    def __init__(self, config: Config):
        check_config(config)
        teacher_dir = None
        if config.teacher:
            teacher_dir = resolve_teacher(config.teacher, download=False)
            t_vocab = config_from_hf(read_hf_config(teacher_dir)).vocab_size
            s_vocab = config_from_hf(read_hf_config(config.student)).vocab_size
            if t_vocab != s_vocab:
                raise SmeltError(f"--teacher vocab_size {t_vocab} != --student vocab_size {s_vocab}")
        cache = config.dataloader.teacher_cache
        if cache:  # the cache stands in for the teacher: none is built
            self.teacher_source = TopKCache(cache).settings["teacher"]
            teacher_dir = None
            if not config.hf_assets_path and not (Path(config.student) / "tokenizer.json").is_file():
                config.hf_assets_path = self.teacher_source  # the tokenizer the cache was built with
        if not config.hf_assets_path:  # the tokenizer travels with the student (or the teacher)
            has_tok = (Path(config.student) / "tokenizer.json").is_file()
            config.hf_assets_path = str(config.student if has_tok or not teacher_dir else teacher_dir)
        # One live run per dump folder (rank 0 holds the lock until it exits; a dead holder's lock is free).
        self._run_lock = RunLock(config.dump_folder).acquire() if int(os.environ.get("RANK", "0")) == 0 else None
        self._stop_requested = False
        self._step_metrics: dict[str, torch.Tensor] = {}
        self._loss_finite: torch.Tensor | None = None
        self._policy, self._policy_step, self._microbatch = None, -1, 0  # the on-policy sampler's student copy
        super().__init__(config)
        own_target = config.model_spec.model.mtp.depth > 0 and config.model_spec.model.mtp.target == "main"
        self.teacher_dir = teacher_dir
        self.student = self.model_parts[0].inner
        # mtp.target main: the frozen main model is the target, so no teacher is built or run (--teacher, if
        # given, only supplies a tokenizer the student lacks).
        self.teacher = self._build_teacher(teacher_dir) if teacher_dir and not own_target else None
        self.distills = self.teacher is not None or bool(cache) or own_target
        self._hidden = self._hook_hidden(config) if config.loss.hidden_keys else None
        self.masks = MaskSet(self.student, MasksOnDisk(config.student), config.mask_learning,
                             load_dense_rows(config.student), config.training.steps, dense_source=self.teacher)
        bad = torch.tensor(self.masks.violations(), device=self.device)  # this rank's shards only
        if dist.is_initialized():
            dist.all_reduce(bad)  # every rank raises, or none does
        if bad.item():
            raise SmeltError(f"--student {config.student}: weights are non-zero where masks.safetensors "
                             f"removes them ({bad.item()} weights); the artifact is broken")
        self._save_checkpoint, self.checkpointer.save = self.checkpointer.save, self._save_with_room
        for opt in self.optimizers.optimizers:
            opt.register_step_pre_hook(self._before_optimizer_step)
            opt.register_step_post_hook(self._after_optimizer_step)
        if config.save_on_signal:
            for s in (signal.SIGTERM, signal.SIGUSR1):
                signal.signal(s, self._on_signal)
        logger.info("student %s (%d masked modules), teacher %s", config.student, len(self.masks),
                    "the frozen main model itself (mtp.target main)" if own_target
                    else teacher_dir or (f"cached top-k ({cache})" if cache else "none (cross-entropy)"))
        # Per rank: shrinks with the rank count, as each rank reads only its shards (train.bench_load).
        logger.info("rank %d loaded: peak RSS %.3f GiB%s", int(os.environ.get("RANK", "0")), peak_rss_gib(),
                    f", peak device memory {torch.cuda.max_memory_allocated() / 2**30:.3f} GiB"
                    if self.device.type == "cuda" else "")

    def _build_teacher(self, teacher_dir: Path) -> Transformer:
        """The frozen teacher, built like the student: on the meta device, sharded, then each rank reads
        only its shards. Stored in the compute dtype (bf16 on GPU recipes: half the memory; fp32 here)."""
        cfg = config_from_hf(read_hf_config(teacher_dir))
        dtype = TORCH_DTYPE_MAP[self.config.training.mixed_precision_param]
        with torch.device("meta"):
            teacher = Transformer(cfg).to(dtype)
        teacher.requires_grad_(False).eval()
        if self.parallel_dims.fsdp_enabled:
            mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
            shard_model(teacher, teacher.layers.values(), fsdp_mesh(self.parallel_dims), mp,
                        gloo=self.device.type == "cpu", forward_only=True)
        teacher.to_empty(device=self.device)
        if cfg.tie_embeddings and teacher.output.weight is not teacher.tok_embeddings.weight:
            teacher.output.weight = teacher.tok_embeddings.weight  # plain to_empty unties; FSDP2 keeps it
        load_into(teacher, teacher_dir)
        teacher.init_rope(self.device)
        return teacher

    def _hook_hidden(self, config: Config) -> dict:
        """Forward hooks that keep the paired blocks' outputs of student and teacher."""
        s_keys = list(self.student.layers)
        hidden = {"on": False, "s": {}, "t": {}}
        for k, i in hidden_pairs(config).items():
            for side, block in (("s", self.student.layers[s_keys[i]]), ("t", self.teacher.layers[k])):
                block.register_forward_hook(lambda mod, args, out, side=side, k=k: self._keep(side, k, out))
        return hidden

    def _keep(self, side: str, key: str, out: torch.Tensor) -> None:
        if self._hidden["on"]:  # not during activation-checkpoint recomputation in backward
            self._hidden[side][key] = out

    def _hidden_loss(self, labels, global_valid_tokens):
        """Sum over valid tokens of the mean over paired blocks of hidden_divergence, / global tokens."""
        h, c = self._hidden, self.config.loss
        keys = c.hidden_keys
        per_token = sum(hidden_divergence(c.hidden_kind, h["s"][k], h["t"][k]) for k in keys) / len(keys)
        h["s"], h["t"] = {}, {}
        loss, mean = _token_mean(per_token, labels, global_valid_tokens)
        return c.hidden_weight * loss, mean

    def _autocast(self):
        """bf16 compute without FSDP (one device): torchtitan casts parameters only through fully_shard."""
        dtype = TORCH_DTYPE_MAP[self.config.training.mixed_precision_param]
        if self.parallel_dims.fsdp_enabled or dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    # ---- one step ------------------------------------------------------------------------------
    def _student_windows(self, inputs, labels):
        """This micro-batch's windows continued by the student (an on-policy step)."""
        if self._policy_step != self.step:  # one gather per step: a collective, every rank, same order
            self._policy = self._gather_student(self._policy)
            self._policy_step, self._microbatch = self.step, 0
        cfg, rank = self.config.on_policy, dist.get_rank() if dist.is_initialized() else 0
        seed = (((cfg.seed * 1_000_003 + self.step) * 1_009 + rank) * 101 + self._microbatch) & (2**63 - 1)
        self._microbatch += 1
        g = torch.Generator(device=self.device).manual_seed(seed)
        return student_windows(self._policy, inputs, labels, cfg, g)

    @torch.no_grad()
    def _gather_student(self, copy: Transformer | None) -> Transformer:
        """The student's current weights in a whole, unsharded model on this rank's device."""
        copy = copy if copy is not None else empty_cpu_copy(self.student).to(self.device)  # tied as the student is
        params, filled = dict(copy.named_parameters()), set()
        for name, p in self.student.named_parameters():
            t = full(p.detach())
            if name in params:
                params[name].copy_(t)
                filled.add(name)
            del t
        if filled != set(params):  # an unfilled parameter would sample from uninitialised memory
            raise SmeltError(f"on-policy sampler: student parameters {sorted(set(params) - filled)[:3]} not found")
        copy.init_rope(self.device)
        return copy

    def _forward_backward_body(self, inputs, labels, global_valid_tokens, extra_kwargs):
        on_policy = self.config.on_policy.is_on_policy(self.step)
        if on_policy:
            inputs, labels = self._student_windows(inputs, labels)
        elif self._policy is not None:  # the whole-model copy lives only through its on-policy step
            self._policy, self._policy_step = None, -1
        self.masks.before_forward(self.step)  # maskllm: this step's soft masks (once per step)
        with self.train_context():
            if self._hidden is not None:
                self._hidden["on"] = True
            teacher_logits = pop_teacher_topk(extra_kwargs)  # a cached teacher's batch, if any
            with self._autocast():
                pred = self.model_parts[0](inputs, **extra_kwargs)
                if self.teacher is not None:
                    with torch.no_grad():
                        teacher_logits = self.teacher(inputs)
            if self._hidden is not None:
                self._hidden["on"] = False
            if isinstance(pred, tuple):  # MTP modules: (main logits or None, [module k's logits], target, nmse)
                main, heads, own, nmse = pred
                loss, metrics = self._mtp_loss(main, heads, labels, global_valid_tokens,
                                               own if own is not None else teacher_logits, nmse)
                del main, heads, own, nmse
            else:
                loss, metrics = self.loss_fn(pred, labels, global_valid_tokens, teacher_logits=teacher_logits)
            if self._hidden is not None:
                hidden_loss, metrics["hidden"] = self._hidden_loss(labels, global_valid_tokens)
                loss = loss + hidden_loss
            if self.config.on_policy.share > 0:
                metrics["on_policy"] = torch.tensor(float(on_policy), device=loss.device)
            del pred, teacher_logits
            with spmd.no_typecheck():
                loss.backward()
        self.masks.apply_to_grads(self.step)
        finite = torch.isfinite(loss.detach()).all()  # a tensor: no device sync per micro-batch
        self._loss_finite = finite if self._loss_finite is None else self._loss_finite & finite
        for k, v in metrics.items():
            self._step_metrics[k] = v.detach().float()
        return loss

    def _mtp_loss(self, main, heads, labels, global_valid_tokens, teacher_logits, nmse=None):
        """The main model's loss (joint mode) + weight * the mean over modules of each module's loss: module k
        predicts labels[:, k:] and is distilled to the target's distribution there (teacher_logits[:, k:]:
        the teacher's, or with mtp.target "main" the frozen main model's own), plus feature_weight x its
        per-token feature nMSE (nmse[k-1]) summed over valid tokens / the global token count."""
        cfg = self.config.model_spec.model.mtp
        loss, metrics = (self.loss_fn(main, labels, global_valid_tokens, teacher_logits=teacher_logits)
                         if main is not None else (0.0, {}))
        weight = cfg.weight if main is not None else 1.0
        for k, logits in enumerate(heads, start=1):
            lk, mk = self.loss_fn(logits, labels[:, k:], global_valid_tokens,
                                  teacher_logits=None if teacher_logits is None else teacher_logits[:, k:])
            if nmse is not None:
                feature, mk["feature_nmse"] = _token_mean(nmse[k - 1], labels[:, k:], global_valid_tokens)
                lk = lk + cfg.feature_weight * feature
            loss = loss + weight * lk / len(heads)
            metrics.update({f"mtp{k}_{name}": v for name, v in mk.items()})
        return loss, metrics

    def _before_optimizer_step(self, optimizer, args, kwargs):
        grads = [torch.isfinite(local(p.grad)).all()
                 for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        one = torch.ones((), dtype=torch.bool, device=self.device)
        loss_ok = one if self._loss_finite is None else self._loss_finite.to(self.device)
        grads_ok = torch.stack(grads).all().to(self.device) if grads else one
        # On the trainer's device: NCCL reduces only CUDA tensors.
        ok = torch.stack([loss_ok, grads_ok]).to(torch.int32)
        if dist.is_initialized():
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        self._loss_finite = None
        loss_ok, grads_ok = ok.tolist()  # the one device sync of the check
        if not (loss_ok and grads_ok):
            what = "loss is NaN/inf" if not loss_ok else "a gradient is NaN/inf"
            raise TrainingStopped(f"step {self.step}: {what}; stopped before the optimizer step "
                                  f"(the last checkpoint is unchanged)")
        self.masks.before_step(self.step)

    def _after_optimizer_step(self, optimizer, args, kwargs):
        self.masks.after_step(self.step)
        if self._step_metrics and self.metrics_processor.should_log(self.step):
            vals = torch.stack(list(self._step_metrics.values())).to(self.device)
            if dist.is_initialized():
                dist.all_reduce(vals)
                vals /= dist.get_world_size()
            logged = {f"loss_metrics/{k}": float(v) for k, v in zip(self._step_metrics, vals)}
            if self.masks.selecting(self.step) and self.masks.flipped is not None:  # summed, not a rank mean
                flipped = self.masks.flipped.to(self.device)
                if dist.is_initialized():
                    dist.all_reduce(flipped)
                logged["masks/flipped_groups"] = int(flipped)
            self.metrics_processor.logger.log(logged, self.step)
        self._step_metrics = {}

    # ---- checkpoint state: the step, and a learning mask's latents ------------------------------
    def state_dict(self):
        state = super().state_dict()
        if getattr(self, "masks", None) is not None and self.masks.learns:
            state["mask_learning"] = self.masks.state_dict()
        return state

    def load_state_dict(self, state):
        super().load_state_dict(state)
        if getattr(self, "masks", None) is not None and self.masks.learns:
            self.masks.load_state_dict(state["mask_learning"])

    # ---- preemption ----------------------------------------------------------------------------
    def _on_signal(self, signum, frame):
        logger.warning(f"received signal {signum}: checkpointing after the current step")
        self._stop_requested = True

    def should_continue_training(self) -> bool:
        stop_file = os.environ.get("SMELT_STOP_FILE")  # slurm/task.sh: a USR1 that came before our handler
        if stop_file and os.path.exists(stop_file):
            self._stop_requested = True
        flag = torch.tensor([int(self._stop_requested)], dtype=torch.int32, device=self.device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank must take the same branch
        if flag.item():
            ck = self.checkpointer
            just_saved = ck._should_save(self.step, last_step=self.step == self.config.training.steps)
            if ck.enable and self.step > 0 and not just_saved:
                ck.save(self.step, last_step=True)
            logger.warning(f"stopping at step {self.step} after a signal; rerun the same command to resume")
            self.stopped_by_signal = True
            return False
        return super().should_continue_training()

    # ---- saves and export: the waits of the end of a stage ---------------------------------------
    def _timeouts(self, seconds: int) -> None:
        """Every process group's collective timeout (torchtitan's own switch: all ranks meet first)."""
        if dist.is_initialized():
            set_pg_timeouts(timedelta(seconds=seconds), self.parallel_dims)

    def _save_with_room(self, step: int, last_step: bool = False) -> None:
        """torchtitan's checkpoint save, under export_timeout_seconds when it writes: a DCP save of a large
        model outlasts comm.train_timeout_seconds. The ranks meet before and after (every rank saves)."""
        if not self.checkpointer._should_save(step, last_step=last_step):
            return self._save_checkpoint(step, last_step=last_step)
        self._timeouts(self.config.export_timeout_seconds)
        self._save_checkpoint(step, last_step=last_step)
        saved = Path(self.checkpointer._create_checkpoint_id(step))
        if int(os.environ.get("RANK", "0")) == 0 and saved.is_dir():  # what `python -m train.export` reads
            atomic_write_text(saved / EXPORT_INFO, json.dumps(self.export_info(), indent=1) + "\n")
        self._timeouts(self.config.comm.train_timeout_seconds)

    def train(self):
        self.stopped_by_signal = False
        super().train()
        logger.info("rank %d trained to step %d: peak RSS %.3f GiB", int(os.environ.get("RANK", "0")), self.step,
                    peak_rss_gib())
        # From here the ranks wait on rank 0 (the export, then train.run's last barrier): the long timeout.
        self._timeouts(self.config.export_timeout_seconds)
        if self.config.export_dir and not self.stopped_by_signal and self.step == self.config.training.steps:
            self.export(Path(self.config.export_dir))

    def export_info(self) -> dict:
        """What turns this run's student into an artifact (train.export): the model's build, the artifact it
        started from, the tokenizer, the stage and the manifest's settings at this step. Rank 0 writes it
        beside every checkpoint, so any saved step can be exported offline."""
        cfg, spec = self.config, self.config.model_spec.model
        heads = self.model_parts[0].mtp
        tok_src = cfg.student if (Path(cfg.student) / "tokenizer.json").is_file() else self.teacher_dir
        return {"format": EXPORT_INFO_FORMAT, "student": cfg.student, "tokenizer": str(tok_src or ""),
                "stage": ("mtp" if heads is not None else "qat" if spec.fake_quant.enable
                          else "distill" if self.distills else "train"),
                "model": {"arch": spec.arch, "fake_quant": _plain(spec.fake_quant), "mtp": _plain(spec.mtp)},
                "mask_pattern_m": self.masks.learning.nm.m if self.masks.learns else 0,
                "settings": {
                    "student": cfg.student, "teacher": str(self.teacher_dir or getattr(self, "teacher_source", "")),
                    "loss": _plain(cfg.loss), "steps": self.step, "tokens_seen": int(self.ntokens_seen),
                    "local_batch_size": cfg.training.local_batch_size, "seq_len": cfg.training.seq_len,
                    "dp_shard": self.parallel_dims.dp_shard, "optimizer": _plain(cfg.optimizer),
                    "fake_quant": _plain(spec.fake_quant), "mtp": _plain(spec.mtp), "data": _plain(cfg.dataloader),
                    "mask_learning": _plain(cfg.mask_learning), "on_policy": _plain(cfg.on_policy)}}

    @torch.no_grad()
    def export(self, out_dir: Path) -> None:
        """Gather the student (collective) and write it as an artifact from rank 0 (train.export).

        A QAT student is written as its fake-quantized weights (so the artifact's logits are the
        quantized model's) plus qparams.safetensors with the scales the release packs.
        """
        g = gather(self.student, self.masks.pairs, self.model_parts[0].mtp)
        if g is not None:
            write_from_info(g, out_dir, self.export_info())
            logger.info("exported the student to %s", out_dir)


def _plain(cfg) -> dict:
    try:
        return json.loads(json.dumps(asdict(cfg), default=str))
    except TypeError:
        return {}
