"""Does the transposed OBS column sweep change what GPTQ optimises? The layer-wise loss
tr(ΔW H ΔWᵀ) of GPTQ W4 g64 (act-order) with the sweep of commit 82536b8 and with this checkout's, on the
real teacher's first 3 blocks (16 calibration windows of the recipe's mix).

    python experiments/check_sweep_equivalence.py > results/bench/oneshot-amd/sweep-equivalence.txt
"""
import subprocess
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import core.obs
import qat.gptq
from core.calibrate import CalibConfig, run_blocks
from models.hf_io import load_hf, load_tokenizer
from models.teacher import resolve_teacher
from qat.quantizers import QuantSpec

BEFORE = "82536b8"  # the commit before the transposed sweep
BLOCKS = 3


def sweep_at(commit: str):
    """obs_column_sweep as core/obs.py had it at `commit` (our own repository's source, read with git show)."""
    src = subprocess.run(["git", "show", f"{commit}:core/obs.py"], capture_output=True, text=True, check=True).stdout
    module = types.ModuleType(f"obs_{commit}")
    exec(compile(src, f"{commit}:core/obs.py", "exec"), module.__dict__)  # noqa: S102 (this repository's own past source)
    return module.obs_column_sweep


def main() -> None:
    teacher = resolve_teacher("smollm2-135m")
    model, tokenizer = load_hf(teacher), load_tokenizer(teacher)
    cfg = CalibConfig(n_windows=16, corpus="wikitext2-valid+code-train+zh-train")
    layers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # name -> (W, H in fp64)

    def on_block(prefix, block, stats):
        if int(prefix.split(".")[1]) < BLOCKS:
            modules = dict(block.named_modules())
            for name, st in stats.items():
                layers[name] = (modules[name[len(prefix) + 1:]].weight.detach().clone(), st.H.double().clone())

    run_blocks(model, cfg.windows(tokenizer), on_block, cfg, progress=False)
    sweeps = {"old": sweep_at(BEFORE), "new": core.obs.obs_column_sweep}
    spec = QuantSpec(bits=4, group_size=64, symmetric=True)
    total = dict.fromkeys(sweeps, 0.0)
    for name, (W, H) in layers.items():
        for label, sweep in sweeps.items():
            qat.gptq.obs_column_sweep = sweep  # gptq_quantize calls the sweep through its module global
            Wq = qat.gptq.gptq_quantize(W, H.float(), spec, act_order=True)[0]
            d = (Wq - W).double()
            loss = float(torch.einsum("ij,jk,ik->", d, H, d))
            total[label] += loss
            print(name, label, f"{loss:.6g}")
    print(total, total["new"] / total["old"] - 1)


if __name__ == "__main__":
    main()
