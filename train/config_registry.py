"""Config functions for `python -m train.launch --nproc N -- --module train.config_registry --config NAME`.

Each returns a complete SmeltTrainer.Config; the command line overrides any field
(`--student DIR --teacher DIR --training.steps 50 --dump_folder runs/x`) except the model's
(torchtitan keeps model_spec off the command line), so fake quantization is set here only.
Every public function defined in this module is a config (the launcher lists them).
"""
from __future__ import annotations

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.config import CommConfig, DebugConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed.activation_checkpoint import FullAC
from torchtitan.protocols.model_spec import ModelSpec

from models.mtp import MTPConfig
from qat.fake_quant import FakeQuantConfig
from train.titan import HFTokenizer, KDLoss, SmeltModel, StreamDataLoader, parallelize
from train.trainer import SmeltTrainer


def _model_spec() -> ModelSpec:
    return ModelSpec(name="smelt-llama", flavor="from-artifact", model=SmeltModel.Config(),
                     parallelize_fn=parallelize, pipelining_fn=None, post_optimizer_build_fn=None,
                     state_dict_adapter=None)


def _config(*, steps: int, batch: int, seq_len: int, lr: float, warmup: int, interval: int,
            dtype: str = "float32", deterministic: bool = True) -> SmeltTrainer.Config:
    # No weight decay: recovery and QAT stay near the teacher, decay would pull weights towards 0.
    opt = default_adamw(lr=lr, weight_decay=0.0)
    opt.implementation = "foreach"
    return SmeltTrainer.Config(
        model_spec=_model_spec(),
        dump_folder="runs/train",
        hf_assets_path="",  # filled from --student (or --teacher) by SmeltTrainer
        tokenizer=HFTokenizer.Config(),
        dataloader=StreamDataLoader.Config(source="wikitext2-valid", seed=0),
        loss=KDLoss.Config(kind="forward_kl", temperature=1.0),
        optimizer=opt,
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=warmup, decay_type="cosine", min_lr_factor=0.1),
        training=TrainingConfig(local_batch_size=batch, seq_len=seq_len, steps=steps, max_norm=1.0,
                                dtype="float32", mixed_precision_param=dtype, disable_cuda_graphs=True),
        parallelism=ParallelismConfig(data_parallel_shard_degree=-1, spmd_backend="partial_dtensor"),
        checkpoint=CheckpointManager.Config(enable=True, folder="checkpoint", interval=interval,
                                            last_save_model_only=False, keep_latest_k=2),
        activation_checkpoint=None,
        # wandb on everywhere; offline unless WANDB_MODE=online (core.tracking sets the run's identity).
        metrics=MetricsProcessor.Config(log_freq=1, disable_color_printing=True, enable_wandb=True),
        comm=CommConfig(trace_buf_size=0),
        debug=DebugConfig(seed=0, deterministic=deterministic),
    )


def debug_distill() -> SmeltTrainer.Config:
    """Tiny models, a few steps: what the tests run (2 gloo processes, FSDP2 shard degree 2)."""
    return _config(steps=6, batch=2, seq_len=32, lr=1e-3, warmup=1, interval=2)


# English, code and Chinese training text (evaluation text never): each bucket the report measures.
MIXED_CORPUS = "wikitext2-valid+code-train+zh-train"


def smollm2_recover() -> SmeltTrainer.Config:
    """Recovery distillation of a pruned SmolLM2-135M on the mixed corpus, sized for a CPU."""
    cfg = _config(steps=120, batch=2, seq_len=256, lr=1e-4, warmup=10, interval=40)
    cfg.dataloader.source = MIXED_CORPUS
    cfg.training.global_batch_size = 4  # 4 x 256 tokens per step whatever the rank count
    return cfg


def h100_recover() -> SmeltTrainer.Config:
    """The same recovery on H100 nodes: bf16 compute (fp32 masters and reductions), full activation
    checkpointing, not deterministic (deterministic kernels cost speed); `--compile.enable` compiles blocks.
    Global batch 128 x 2048 tokens whatever the node count (gradient accumulation fills it)."""
    cfg = _config(steps=2000, batch=8, seq_len=2048, lr=2e-4, warmup=100, interval=250, dtype="bfloat16",
                  deterministic=False)
    cfg.training.global_batch_size = 128
    cfg.dataloader.source = MIXED_CORPUS
    cfg.activation_checkpoint = FullAC.Config()
    cfg.optimizer.implementation = "fused"  # one kernel per step on CUDA (foreach on CPU runs)
    return cfg


def h100_qat() -> SmeltTrainer.Config:
    """W4 g64 symmetric QAT on H100 nodes (the release's grid): bf16 compute, the quantization arithmetic on
    fp32 weights."""
    cfg = h100_recover()
    cfg.training.steps, cfg.lr_scheduler.warmup_steps = 1000, 50
    cfg.optimizer.param_groups[0].optimizer_kwargs["lr"] = 2e-5
    cfg.model_spec.model.fake_quant = FakeQuantConfig(enable=True, bits=4, symmetric=True, group_size=64,
                                                      scale_init="mse", learn_scale=True)
    return cfg


def debug_diverge() -> SmeltTrainer.Config:
    """debug_distill with an absurd learning rate: exercises the NaN/inf stop (tests)."""
    return _config(steps=8, batch=2, seq_len=32, lr=1e30, warmup=0, interval=1)


def debug_qat() -> SmeltTrainer.Config:
    """Tiny QAT run: int4 symmetric g32 fake quantization (STE) + KL to the teacher (tests)."""
    cfg = _config(steps=4, batch=2, seq_len=32, lr=1e-3, warmup=1, interval=2)
    cfg.model_spec.model.fake_quant = FakeQuantConfig(enable=True, bits=4, symmetric=True, group_size=32)
    return cfg


def smollm2_qat() -> SmeltTrainer.Config:
    """W4 g64 symmetric QAT of SmolLM2-135M with KD to its full-precision self: 300 steps of 4 x 256.

    Learned (LSQ) scales initialised from the starting artifact's qparams (GPTQ) when present, else by
    MSE-searched clipping. Global batch 4 whatever the rank count (gradient accumulation fills it).
    """
    # lr 6e-5: measured over 2e-5 at 300 steps (en KL 0.104 vs 0.125, P99 0.658 vs 0.786; docs/quantization.md).
    cfg = _config(steps=300, batch=2, seq_len=256, lr=6e-5, warmup=10, interval=50)
    cfg.training.global_batch_size = 4
    cfg.dataloader.source = MIXED_CORPUS
    cfg.model_spec.model.fake_quant = FakeQuantConfig(enable=True, bits=4, symmetric=True, group_size=64,
                                                      scale_init="mse", learn_scale=True)
    return cfg


def _mtp(cfg: SmeltTrainer.Config, depth: int = 1, target: str = "teacher") -> SmeltTrainer.Config:
    """MTP modules on the frozen main model: CE on the shifted targets + 1.0 x KL to the target there (the
    teacher, or with target "main" the frozen main model's own distribution: no teacher forward)."""
    cfg.model_spec.model.mtp = MTPConfig(depth=depth, target=target)
    cfg.loss.ce_weight, cfg.loss.kd_weight = 1.0, 1.0
    return cfg


def h100_mtp() -> SmeltTrainer.Config:
    """One MTP module on the frozen recovered model, on H100 nodes (bf16 compute, fp32 masters)."""
    cfg = _mtp(_config(steps=1000, batch=8, seq_len=2048, lr=3e-4, warmup=50, interval=250, dtype="bfloat16",
                       deterministic=False))
    cfg.training.global_batch_size = 128
    cfg.dataloader.source = MIXED_CORPUS
    cfg.optimizer.implementation = "fused"
    return cfg


def h100_mtp_realign() -> SmeltTrainer.Config:
    """Re-align the MTP module on the frozen QAT'd model, on H100 nodes: KL only to that model's own
    distribution (what verifies the drafts), lr 1e-4 with a new warm-up, on its own 256-token continuations
    (smollm2_mtp_realign_kl's protocol)."""
    cfg = _mtp(_config(steps=100, batch=8, seq_len=256, lr=1e-4, warmup=10, interval=50, dtype="bfloat16",
                       deterministic=False), target="main")
    cfg.loss.ce_weight = 0.0
    cfg.training.global_batch_size = 128
    cfg.optimizer.implementation = "fused"
    return cfg


def debug_mtp() -> SmeltTrainer.Config:
    """Tiny MTP run (depth 2) on a frozen main model (tests)."""
    return _mtp(_config(steps=6, batch=2, seq_len=32, lr=3e-3, warmup=1, interval=2), depth=2)


def debug_mtp_main() -> SmeltTrainer.Config:
    """debug_mtp distilled to the frozen main model itself (mtp.target main; no teacher is run) (tests)."""
    return _mtp(_config(steps=6, batch=2, seq_len=32, lr=3e-3, warmup=1, interval=2), depth=2, target="main")


def debug_mtp_features() -> SmeltTrainer.Config:
    """debug_mtp_main plus the EAGLE-style feature regression (mtp.feature_weight 1) (tests)."""
    cfg = debug_mtp_main()
    cfg.model_spec.model.mtp.feature_weight = 1.0
    return cfg


def debug_mtp_fused() -> SmeltTrainer.Config:
    """debug_mtp_main whose first module also reads the main model's first block (mtp.fuse_layers) (tests)."""
    cfg = debug_mtp_main()
    cfg.model_spec.model.mtp.fuse_layers = (0,)
    return cfg


def debug_mtp_joint() -> SmeltTrainer.Config:
    """Tiny joint run: the main model trains too (its loss + 0.5 x the MTP loss) (tests)."""
    cfg = _mtp(_config(steps=4, batch=2, seq_len=32, lr=1e-3, warmup=1, interval=2), depth=1)
    cfg.model_spec.model.mtp.joint, cfg.model_spec.model.mtp.weight = True, 0.5
    cfg.loss.ce_weight = 0.0  # both distil to the teacher (KL), as recovery does
    return cfg


def smollm2_mtp() -> SmeltTrainer.Config:
    """One MTP module (depth 1) for SmolLM2-135M on the frozen recovered model: 4 x 256 tokens a step.
    lr 5e-4: at 1e-3 the loss spiked back to its starting value after 24 steps (docs/mtp.md)."""
    cfg = _mtp(_config(steps=600, batch=2, seq_len=256, lr=5e-4, warmup=20, interval=50))
    cfg.training.global_batch_size = 4
    cfg.dataloader.source = MIXED_CORPUS
    return cfg


def smollm2_mtp_main() -> SmeltTrainer.Config:
    """smollm2_mtp with the KL to the frozen main model's own distribution (the one that verifies the
    drafts) instead of the teacher's: no teacher is built or run."""
    cfg = smollm2_mtp()
    cfg.model_spec.model.mtp.target = "main"
    return cfg


def smollm2_mtp_features() -> SmeltTrainer.Config:
    """smollm2_mtp_main plus the EAGLE-style feature regression: + 1.0 x the normalised MSE between what the
    head reads from the module at i and from the main model at i + 1 (mtp.feature_weight)."""
    cfg = smollm2_mtp_main()
    cfg.model_spec.model.mtp.feature_weight = 1.0
    return cfg


def smollm2_mtp_realign() -> SmeltTrainer.Config:
    """Re-align the MTP module on the QAT'd model. Its artifact holds the dequantized codes, so the frozen
    main model is exactly the quantized one (no fake quantization needed); its qparams travel on. The KL
    target is that quantized model's own distribution (mtp.target main): what its verification accepts.
    Give it the QAT'd model's own text (distill.self_text --model <the QAT'd artifact>): 150 steps at lr 1e-4
    on that text took α from 0.346 to 0.398; 60 steps at 5e-4 on the pre-QAT model's text lowered it (docs/mtp.md)."""
    cfg = smollm2_mtp_main()
    cfg.training.steps = 150
    cfg.optimizer.param_groups[0].optimizer_kwargs["lr"] = 1e-4
    return cfg


def smollm2_mtp_kl() -> SmeltTrainer.Config:
    """smollm2_mtp_main with KL to the frozen main model only (no CE): for the main model's continuations of
    real 128-token prompts (distill.self_text --prompt-len 128), half of whose positions are real text where
    CE would pull towards the corpus, not towards what verification accepts (docs/mtp.md)."""
    cfg = smollm2_mtp_main()
    cfg.loss.ce_weight = 0.0
    return cfg


def smollm2_mtp_kl_fused() -> SmeltTrainer.Config:
    """smollm2_mtp_kl whose module also reads the main model's residual stream after blocks 2, 15 and 27 (EAGLE-3's
    low / middle / high layers for 30 blocks; mtp.fuse_layers), each under its own norm, next to the final state."""
    cfg = smollm2_mtp_kl()
    cfg.model_spec.model.mtp.fuse_layers = (2, 15, 27)
    return cfg


def smollm2_mtp_realign_kl() -> SmeltTrainer.Config:
    """smollm2_mtp_realign (lr 1e-4, the QAT'd model's own distribution) with KL only, for the QAT'd model's
    continuations of 128-token prompts: the protocol that lifted α 0.508 -> 0.555 in 600 steps (docs/mtp.md)."""
    cfg = smollm2_mtp_realign()
    cfg.loss.ce_weight = 0.0
    return cfg


def smollm2_mtp_realign_kl_fused() -> SmeltTrainer.Config:
    """smollm2_mtp_realign_kl for a module trained with smollm2_mtp_kl_fused (the same fused blocks: an MTP file
    built for other blocks is refused)."""
    cfg = smollm2_mtp_realign_kl()
    cfg.model_spec.model.mtp.fuse_layers = (2, 15, 27)
    return cfg
