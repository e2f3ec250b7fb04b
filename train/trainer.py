"""SmeltTrainer: torchtitan's Trainer plus a frozen teacher, fixed sparsity masks, fault handling, export.

- Teacher: the model before compression, full precision, frozen. It is a plain attribute (not in
  model_parts), so it is not in the optimizer, not clipped and not in the checkpoint; it is sharded with
  FSDP2 like the student so a large teacher fits.
- Masks: masks.safetensors of the student artifact become a MaskSet; gradients of removed weights are
  zeroed after every backward and the weights re-masked after every optimizer step.
- Faults: SIGTERM/SIGUSR1 -> checkpoint after the current step, exit 0 (Slurm preemption/time-out);
  a NaN/inf loss or gradient stops before the optimizer step, so the last checkpoint stays good.
- Export: at the last step the student is gathered and written as an HF artifact (+ masks, manifest).
"""
from __future__ import annotations

import json
import signal
from dataclasses import asdict, dataclass
from pathlib import Path

import spmd_types as spmd
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from core.artifact import parent_record, write_manifest
from core.dtensor import full, local
from core.errors import SmeltError
from core.files import atomic_dir
from core.masks import load_masks, save_masks
from models.hf_io import config_from_hf, load_hf, load_tokenizer, read_hf_config, save_hf
from models.llama import Transformer
from models.teacher import resolve_teacher
from qat.fake_quant import fake_quant_modules, freeze
from qat.qparams import save_qparams
from qat.quantizers import dequantize
from train.masks import MaskSet
from train.titan import fsdp_mesh, shard_model


class TrainingStopped(SmeltError):
    """Training cannot continue (non-finite loss or gradient); the message names the step (one line, exit 2)."""


def check_config(config: SmeltTrainer.Config) -> None:
    """The checks that need no model or process group (train.launch runs them before the ranks start)."""
    if not config.student or not Path(config.student).is_dir():
        raise SmeltError(f"--student {config.student!r}: artifact directory does not exist")
    ck = config.checkpoint
    if ck.enable and ck.load_step > 0:
        step_dir = Path(config.dump_folder) / ck.folder / f"step-{ck.load_step}"
        if not (step_dir / ".metadata").is_file():
            raise SmeltError(f"--checkpoint.load_step {ck.load_step}: no checkpoint at {step_dir}")
    if config.model_spec.model.fake_quant.enable and config.training.mixed_precision_param != "float32":
        # A bf16 forward would round the weights before quantizing, and the exported codes (from the fp32
        # masters) would then differ from the ones trained.
        raise SmeltError(f"fake_quant needs --training.mixed_precision_param float32, not "
                         f"{config.training.mixed_precision_param!r}")


class SmeltTrainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        student: str = ""
        """Artifact directory (HF layout) holding the student's starting weights and optional masks."""
        teacher: str = ""
        """Teacher HF directory, .gguf or registered name. Empty: plain next-token cross-entropy."""
        export_dir: str = ""
        """Write the trained student here (HF layout + masks + manifest) after the last step."""
        save_on_signal: bool = True
        """Checkpoint and exit cleanly on SIGTERM / SIGUSR1."""

    def __init__(self, config: Config):
        check_config(config)
        teacher_dir = None
        if config.teacher:
            teacher_dir = resolve_teacher(config.teacher, download=False)
            t_vocab = config_from_hf(read_hf_config(teacher_dir)).vocab_size
            s_vocab = config_from_hf(read_hf_config(config.student)).vocab_size
            if t_vocab != s_vocab:
                raise SmeltError(f"--teacher vocab_size {t_vocab} != --student vocab_size {s_vocab}")
        if not config.hf_assets_path:  # the tokenizer travels with the student (or the teacher)
            has_tok = (Path(config.student) / "tokenizer.json").is_file()
            config.hf_assets_path = str(config.student if has_tok or not teacher_dir else teacher_dir)
        self._stop_requested = False
        self._step_metrics: dict[str, torch.Tensor] = {}
        self._loss_finite = True
        super().__init__(config)
        self.teacher_dir = teacher_dir
        self.student = self.model_parts[0].inner
        self.teacher = self._build_teacher(teacher_dir) if teacher_dir else None
        self.masks = MaskSet(self.student, load_masks(config.student))
        if len(self.masks) and self.masks.violations():
            raise SmeltError(f"--student {config.student}: weights are non-zero where masks.safetensors "
                             f"removes them ({self.masks.violations()} weights); the artifact is broken")
        for opt in self.optimizers.optimizers:
            opt.register_step_pre_hook(self._before_optimizer_step)
            opt.register_step_post_hook(self._after_optimizer_step)
        if config.save_on_signal:
            for s in (signal.SIGTERM, signal.SIGUSR1):
                signal.signal(s, self._on_signal)
        logger.info("student %s (%d masked modules), teacher %s", config.student, len(self.masks),
                    teacher_dir or "none (cross-entropy)")

    def _build_teacher(self, teacher_dir: Path) -> Transformer:
        teacher = load_hf(teacher_dir).to(self.device)
        teacher.requires_grad_(False).eval()
        if self.parallel_dims.fsdp_enabled:
            tr = self.config.training
            mp = MixedPrecisionPolicy(param_dtype=TORCH_DTYPE_MAP[tr.mixed_precision_param],
                                      reduce_dtype=TORCH_DTYPE_MAP[tr.mixed_precision_reduce])
            shard_model(teacher, teacher.layers.values(), fsdp_mesh(self.parallel_dims), mp,
                        gloo=self.device.type == "cpu")
        return teacher

    # ---- one step ------------------------------------------------------------------------------
    def _forward_backward_body(self, inputs, labels, global_valid_tokens, extra_kwargs):
        with self.train_context():
            pred = self.model_parts[0](inputs, **extra_kwargs)
            teacher_logits = None
            if self.teacher is not None:
                with torch.no_grad():
                    teacher_logits = self.teacher(inputs)
            loss, metrics = self.loss_fn(pred, labels, global_valid_tokens, teacher_logits=teacher_logits)
            del pred, teacher_logits
            with spmd.no_typecheck():
                loss.backward()
        self.masks.apply_to_grads()
        self._loss_finite = self._loss_finite and bool(torch.isfinite(loss.detach()).item())
        for k, v in metrics.items():
            self._step_metrics[k] = v.detach().float()
        return loss

    def _before_optimizer_step(self, optimizer, args, kwargs):
        grads_finite = all(bool(torch.isfinite(local(p.grad)).all())
                           for g in optimizer.param_groups for p in g["params"] if p.grad is not None)
        ok = torch.tensor([int(self._loss_finite), int(grads_finite)], dtype=torch.int32)
        if dist.is_initialized():
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        self._loss_finite = True
        if not ok.all():
            what = "loss is NaN/inf" if not ok[0] else "a gradient is NaN/inf"
            raise TrainingStopped(f"step {self.step}: {what}; stopped before the optimizer step "
                                  f"(the last checkpoint is unchanged)")

    def _after_optimizer_step(self, optimizer, args, kwargs):
        self.masks.apply_to_weights()
        if self._step_metrics and self.metrics_processor.should_log(self.step):
            vals = torch.stack(list(self._step_metrics.values()))
            if dist.is_initialized():
                dist.all_reduce(vals)
                vals /= dist.get_world_size()
            self.metrics_processor.logger.log(
                {f"loss_metrics/{k}": float(v) for k, v in zip(self._step_metrics, vals)}, self.step)
        self._step_metrics = {}

    # ---- preemption ----------------------------------------------------------------------------
    def _on_signal(self, signum, frame):
        logger.warning(f"received signal {signum}: checkpointing after the current step")
        self._stop_requested = True

    def should_continue_training(self) -> bool:
        flag = torch.tensor([int(self._stop_requested)], dtype=torch.int32)
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

    # ---- export --------------------------------------------------------------------------------
    def train(self):
        self.stopped_by_signal = False
        super().train()
        if self.config.export_dir and not self.stopped_by_signal and self.step == self.config.training.steps:
            self.export(Path(self.config.export_dir))

    @torch.no_grad()
    def export(self, out_dir: Path) -> None:
        """Gather the student (collective) and write it as an artifact from rank 0.

        A QAT student is written as its fake-quantized weights (so the artifact's logits are the
        quantized model's) plus qparams.safetensors with the scales the release packs.
        """
        weights = {name: full(p).detach().float().cpu() for name, p in self.student.named_parameters()}
        frozen = freeze(self.student) if fake_quant_modules(self.student) else {}
        masks = {n: full(m.to(torch.uint8)).bool().cpu() for n, _, m in self.masks.pairs}
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        with torch.device("meta"):
            model = Transformer(self.student.cfg)
        model = model.to_empty(device="cpu")
        for k in set(model.layers.keys()) - set(self.student.layers.keys()):
            del model.layers[k]  # depth-pruned students keep their original layer keys
        spec = None
        for name, (q, scale, zp) in frozen.items():
            spec = fake_quant_modules(self.student)[name].spec
            weights[f"{name}.weight"] = dequantize(q, scale, zp, spec).float()
        wanted = model.state_dict().keys()
        model.load_state_dict({k: v for k, v in weights.items() if k in wanted}, strict=False)
        if model.cfg.tie_embeddings:
            model.output.weight = model.tok_embeddings.weight
        cfg = self.config
        tok_src = cfg.student if (Path(cfg.student) / "tokenizer.json").is_file() else self.teacher_dir
        stage = "qat" if frozen else ("distill" if self.teacher is not None else "train")
        with atomic_dir(out_dir, overwrite=True) as tmp:
            save_hf(model, tmp, tokenizer=load_tokenizer(tok_src) if tok_src else None)
            if masks:
                save_masks(model, masks, tmp)
            if frozen:
                save_qparams(model, {n: (s, z) for n, (_, s, z) in frozen.items()}, spec, tmp)
            write_manifest(tmp, stage=stage, settings={
                "student": cfg.student, "teacher": str(self.teacher_dir or ""),
                "loss": _plain(cfg.loss), "steps": self.step, "tokens_seen": int(self.ntokens_seen),
                "local_batch_size": cfg.training.local_batch_size, "seq_len": cfg.training.seq_len,
                "dp_shard": self.parallel_dims.dp_shard, "optimizer": _plain(cfg.optimizer),
                "fake_quant": _plain(cfg.model_spec.model.fake_quant),
                "data": _plain(cfg.dataloader),
            }, parent=parent_record(cfg.student))
        logger.info("exported the student to %s", out_dir)


def _plain(cfg) -> dict:
    try:
        return json.loads(json.dumps(asdict(cfg), default=str))
    except TypeError:
        return {}
