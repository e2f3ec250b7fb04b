"""The recipe file's types: the stage kinds, one typed dataclass per kind of [[stages]] table, data, parallelism and
the recipe itself. configs.recipe_spec loads a TOML into them and checks it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from core.data import SelfTextConfig

KINDS = ("teacher", "heads", "prune", "reconstruct", "teacher_cache", "recover", "self_text", "mtp", "ptq", "qreconstruct",
         "qat", "release", "verify", "report", "evaluate")
TRAINING = ("recover", "mtp", "qat")
MODELS = ("prune", "reconstruct", "recover", "mtp", "ptq", "qreconstruct", "qat")  # write an HF artifact, evaluated
# against the teacher
QUANTIZED = ("ptq", "qreconstruct", "qat")  # write a quantized artifact (qparams): what a qreconstruct stage reads
FLOAT_MODELS = tuple(k for k in MODELS if k not in QUANTIZED)  # what a qreconstruct stage may aim at (its target)
NAME = re.compile(r"[A-Za-z0-9_.-]+")  # a stage name is a Slurm job name and a file name
PY = "python"  # sys.executable in the commands (printed as `python`)


@dataclass
class Data:
    train: str | None = None        # training text source (--dataloader.source); None: the config's own
    calibration: str | None = None  # prune/ptq calibration corpus (--calib-corpus); None: their default
    # how the calibrating stages draw a corpus mix's windows (--calib-sampling): "disjoint" (no token in two
    # windows) or "overlapping" (independent offsets, the CLIs' default)
    calibration_sampling: str = "disjoint"


@dataclass
class Parallelism:
    nodes: int = 1
    nproc: int = 1                  # ranks per node: GPUs per node, or CPU processes
    device: str = "cpu"             # what the memory estimate is per: "cpu" (rank) or "gpu"
    gpu_memory_gib: float | None = None  # the plan flags a training stage estimated above it


@dataclass
class Stage:
    kind: str
    name: str = ""                  # default: the kind
    needle: bool = False            # the stage's evaluation also runs eval.needle (stages that evaluate)
    src: str = field(default="", init=False)  # resolved input (check)
    dst: str = field(default="", init=False)  # resolved output

    def needs(self) -> tuple[str, ...]:
        """The resolved paths this stage reads: each must exist before it runs (the teacher's name excepted)."""
        return (self.src,)


@dataclass
class TeacherStage(Stage):          # models.teacher (fetch, verify, import); zh-train if used; evaluate
    evaluate: bool = True


@dataclass
class HeadsStage(Stage):            # prune.heads on the teacher: run_dir/<out>.json (+ .png), the protected set
    out: str = ""
    top_k: int | None = None        # protected heads per score; None: prune.heads' default
    calib_windows: int | None = None
    needle_lengths: str | None = None  # the retrieval probe's prompt lengths, e.g. "512,1024"
    needle_samples: int | None = None  # the probe's prompts per (length, depth); None: prune.heads' default


@dataclass
class PruneStage(Stage):            # prune.run on the teacher
    out: str = ""                   # directory under run_dir; default: the stage name
    method: str = "sparsegpt"
    protect: str | None = None      # a heads stage's name or a prune.heads JSON: those heads' rows stay dense
    skip: list[str] | None = None   # modules left dense (prune.run --skip: names, dotted prefixes or suffixes);
                                    # None: output and tok_embeddings
    pattern: str | None = None      # N:M, or:
    sparsity: float | None = None
    calib_windows: int | None = None  # None: the CLI's default (core.calibrate.CalibConfig)
    calib_seq_len: int | None = None
    calib_forward: str | None = None  # block forward dtype (core.calibrate.FORWARD_DTYPES); None: float32
    calib_hessian: str | None = None  # each batch's XᵀX product dtype (core.calibrate.HESSIAN_DTYPES); None: float32
    calib_true_sequential: bool = False  # one forward pass per block, each group on the pruned ones' outputs
    refit: str | None = None        # kept weights re-solved for the mask (prune.run --refit layer|teacher); "none"/None: off
    evaluate: bool = True


@dataclass
class ReconstructStage(Stage):      # prune.reconstruct: each block's MLP fitted to the teacher's, masks kept
    input: str = ""                 # a pruned artifact; default: the last model stage
    out: str = ""
    lr: float | None = None         # None (here and below): prune.reconstruct's defaults
    epochs: int | None = None
    inputs: str | None = None       # "teacher", "student" or "block" (prune.reconstruct --inputs)
    fit: str | None = None          # "mlp" or "block": what is trained (prune.reconstruct --fit)
    calib_windows: int | None = None
    calib_seq_len: int | None = None
    evaluate: bool = True


@dataclass
class QuantReconstructStage(ReconstructStage):  # qat.reconstruct: a quantized artifact's blocks fitted on their grid
    scale_lr: float | None = None   # the learned scales' lr; None here and in the fields above: qat.reconstruct's
    target: str | None = None       # whose block outputs the fit aims at: an earlier float model stage (e.g. the
                                    # recovered model) or an HF directory; None: the teacher

    def needs(self) -> tuple[str, ...]:
        return (self.src, self.target or "")


@dataclass
class TeacherCacheStage(Stage):     # distill.teacher_cache: the teacher's top-k over the training windows
    out: str = ""                   # directory under run_dir; default: the stage name
    top_k: int = 64
    windows: int = 0                # steps x global batch of the longest stage reading it (fewer: epochs)
    seq_len: int = 0                # the reading stages' seq_len
    local_batch: int = 0            # ... and local_batch (the cache stores windows in their rank layout)
    dtype: str = "float32"          # the teacher's compute dtype (bfloat16: what a bf16 trainer's teacher runs in)


@dataclass
class SelfTextStage(Stage):         # distill.self_text: a model's own greedy text, what its MTP modules train on
    input: str = ""                 # the model that writes; default: the last model stage
    out: str = ""
    corpus: str | None = None       # the prompts' training corpora; None (here and below): core.data.SelfTextConfig's
    prompts: int | None = None
    prompt_len: int | None = None
    new_tokens: int | None = None
    batch_size: int | None = None
    temperature: float | None = None
    seed: int | None = None
    settings: SelfTextConfig | None = field(default=None, init=False)  # checked, defaults filled (check)


@dataclass
class TrainStage(Stage):            # recover / mtp / qat (train.launch)
    steps: int = 0
    config: str = ""                # a function of train/config_registry.py
    input: str = ""                 # an earlier stage's name or an artifact directory; default: the last
    out: str = ""
    local_batch: int | None = None  # None: the config's value; another value is passed as an override
    global_batch: int | None = None
    seq_len: int | None = None
    dtype: str | None = None        # training.mixed_precision_param; "auto": bfloat16 where bf16 runs fast, else float32
    lr: float | None = None         # the peak learning rate (the config's param group 0); None: the config's
    teacher_cache: str | None = None  # an earlier teacher_cache stage: its windows and top-k, no teacher forward
    source: str | None = None       # training text: an earlier self_text stage or a text source; None: data.train
    evaluate: bool = True
    reads: str = field(default="", init=False)  # the self_text file an earlier stage writes (source)
    budget: dict = field(default_factory=dict, init=False)

    def needs(self) -> tuple[str, ...]:
        return (self.src, self.reads)


@dataclass
class PtqStage(Stage):              # qat.ptq
    input: str = ""
    out: str = ""
    method: str = "gptq"
    bits: int | None = None
    group_size: int | None = None
    act_order: bool = False
    calib_windows: int | None = None  # None: qat.ptq's default (128 x 512, as CalibConfig's)
    calib_seq_len: int | None = None
    calib_forward: str | None = None
    calib_hessian: str | None = None
    calib_true_sequential: bool = False
    evaluate: bool = True


@dataclass
class ReleaseStage(Stage):          # qat.release
    input: str = ""
    out: str = ""
    metrics: bool = True            # keep the input's evaluation (evals/<input>.json) in the manifest
    dtype: str = "bfloat16"         # what the tensors that are not quantized ship in
    sparse_storage: str = "mask"    # 2:4 modules: "mask" (transformers/vLLM load it) or "compressed" (kernels' layout)


@dataclass
class InputStage(Stage):            # verify (qat.verify of a release), evaluate (into evals/<name>.json)
    kernel_layers: int = 0          # verify: also run the release's first N blocks through the Triton kernels
    input: str = ""


TYPES = {"teacher": TeacherStage, "heads": HeadsStage, "prune": PruneStage, "reconstruct": ReconstructStage,
         "qreconstruct": QuantReconstructStage,
         "teacher_cache": TeacherCacheStage,
         "recover": TrainStage, "self_text": SelfTextStage,
         "mtp": TrainStage, "qat": TrainStage, "ptq": PtqStage, "release": ReleaseStage, "verify": InputStage,
         "evaluate": InputStage, "report": Stage}  # report: eval.report over run_dir/evals


@dataclass
class Recipe:
    name: str
    teacher: str                    # registered name, .gguf or HF directory (models.teacher)
    run_dir: str
    stages: list                    # [[stages]] tables; load() builds each by its kind
    teacher_config: str | None = None  # config.json for the plan's shapes when the teacher is elsewhere
    description: str | None = None  # one line each, the catalogue's (configs.recipe_spec.catalog): what it is,
    hardware: str | None = None     # the hardware it is sized for,
    measured: str | None = None     # its wall time and machine as measured, or "not run yet"
    data: Data = field(default_factory=Data)
    parallelism: Parallelism = field(default_factory=Parallelism)
    eval: dict | None = None        # core.data.EvalConfig keys; None: eval.evaluate's defaults

    @property
    def dp(self) -> int:            # FSDP2 shards over every rank (data_parallel_shard_degree = -1)
        return self.parallelism.nodes * self.parallelism.nproc

    def evals(self, artifact: str) -> str:
        return str(Path(self.run_dir) / "evals" / f"{Path(artifact).name}.json")
