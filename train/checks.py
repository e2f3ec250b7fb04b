"""Checks of a training config against its files (student, teacher, teacher cache) that need no model or
process group; train.trainer.check_config runs them, so train.launch refuses a bad run before any rank starts.
Every problem is one line naming the setting."""
from __future__ import annotations

from typing import TYPE_CHECKING

from core.artifact import weights_fingerprint
from core.errors import SmeltError
from core.teacher_topk import TopKCache
from models.hf_io import config_from_hf, read_hf_config
from models.teacher import resolve_teacher
from train.lineage import teacher_blocks

if TYPE_CHECKING:
    from train.trainer import SmeltTrainer


def hidden_pairs(config: SmeltTrainer.Config) -> dict[str, int]:
    """{teacher block key: student block index} for the layer-wise loss's blocks; every problem is one
    line naming the setting."""
    keys = config.loss.hidden_keys
    if not keys or not config.loss.hidden_weight > 0:  # checked here too: the CLI may bypass the config's own
        raise SmeltError(f"--loss.hidden_weight={config.loss.hidden_weight} must be > 0 exactly when "
                         f"--loss.hidden_layers names blocks (got {config.loss.hidden_layers!r})")
    if not config.teacher:
        raise SmeltError("--loss.hidden_weight needs a --teacher (layer-wise targets are its blocks)")
    if config.model_spec.model.mtp.depth:
        raise SmeltError("--loss.hidden_weight: MTP stages train modules on a frozen main model, not its blocks")
    s_cfg = config_from_hf(read_hf_config(config.student))
    t_cfg = config_from_hf(read_hf_config(resolve_teacher(config.teacher, download=False)))
    if s_cfg.dim != t_cfg.dim:
        raise SmeltError(f"--loss.hidden_layers: student width {s_cfg.dim} != teacher width {t_cfg.dim}; "
                         f"their hidden states cannot be compared")
    student_of = {str(t): i for i, t in enumerate(teacher_blocks(config.student, s_cfg.n_layers, t_cfg.n_layers))}
    missing = [k for k in keys if k not in student_of]
    if missing:
        raise SmeltError(f"--loss.hidden_layers: teacher block{'s' * (len(missing) > 1)} {', '.join(missing)} "
                         f"{'are' if len(missing) > 1 else 'is'} not in the student (it keeps teacher blocks "
                         f"{', '.join(student_of)})")
    return {k: student_of[k] for k in keys}


def check_teacher_cache(config: SmeltTrainer.Config) -> TopKCache:
    """The cache against the run: same text (source, seed), window length and teacher; a loss it can feed.
    Every problem is one line naming the setting."""
    what, data = f"--dataloader.teacher_cache {config.dataloader.teacher_cache}", config.dataloader
    try:
        cache = TopKCache(data.teacher_cache)
    except SmeltError as e:
        raise SmeltError(str(e).replace("teacher_cache", "--dataloader.teacher_cache", 1)) from None
    st = cache.settings
    if (st["source"], st["seed"]) != (data.source, data.seed):
        raise SmeltError(f"{what} holds --dataloader.source {st['source']} seed {st['seed']}, the run asks for "
                         f"{data.source} seed {data.seed}")
    for key, cached in st["text"].items():  # the cache was built with the stream's defaults for these
        if getattr(data, key) != cached:
            raise SmeltError(f"{what} was built with --dataloader.{key} {cached!r}, the run asks for "
                             f"{getattr(data, key)!r}")
    if cache.seq_len != config.training.seq_len:
        raise SmeltError(f"{what} holds {cache.seq_len}-token windows; --training.seq_len is "
                         f"{config.training.seq_len}")
    loss = config.loss
    if loss.kind != "forward_kl" or loss.temperature != 1.0:
        raise SmeltError(f"{what}: --loss.kind must be forward_kl and --loss.temperature 1 (the cache holds "
                         f"temperature-1 log-probs), got {loss.kind} / {loss.temperature}")
    if loss.hidden_weight > 0:
        raise SmeltError(f"{what}: --loss.hidden_weight needs the teacher's blocks, which a cache does not hold")
    teacher = resolve_teacher(config.teacher, download=False) if config.teacher else None
    if teacher is not None and weights_fingerprint(teacher) != st["teacher_fingerprint"]:
        raise SmeltError(f"{what} was built from another teacher ({st['teacher']}) than --teacher {config.teacher}")
    s_vocab = config_from_hf(read_hf_config(config.student)).vocab_size
    if s_vocab != st["vocab_size"]:
        raise SmeltError(f"{what}: its teacher's vocab_size {st['vocab_size']} != --student vocab_size {s_vocab}")
    return cache
