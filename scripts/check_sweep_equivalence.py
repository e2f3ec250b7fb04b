"""Issue 15: does the transposed OBS column sweep change what GPTQ optimises? The layer-wise loss of GPTQ W4 g64
(act-order) with the sweep of commit 82536b8 and with today's, on the real teacher's first 3 blocks.

    python scripts/check_sweep_equivalence.py > results/bench/oneshot-amd/sweep-equivalence.txt
"""


import importlib.util, subprocess, sys, torch
sys.path.insert(0, ".")
import core.obs as new_obs
old_src = subprocess.run(["git", "show", "82536b8:core/obs.py"], capture_output=True, text=True).stdout
spec = importlib.util.spec_from_loader("old_obs", loader=None); old_obs = importlib.util.module_from_spec(spec)
exec(old_src, old_obs.__dict__)
from core.calibrate import CalibConfig, run_blocks
from models.hf_io import load_hf, load_tokenizer
from models.teacher import resolve_teacher
import qat.gptq as G
from qat.quantizers import QuantSpec
td = resolve_teacher("smollm2-135m"); model = load_hf(td); tok = load_tokenizer(td)
cfg = CalibConfig(n_windows=16, corpus="wikitext2-valid+code-train+zh-train")
got = {}
def on_block(prefix, block, stats):
    if int(prefix.split(".")[1]) < 3:
        for n, st in stats.items(): got[n] = (dict(block.named_modules())[n[len(prefix)+1:]].weight.detach().clone(), st.H.double().clone())
run_blocks(model, cfg.windows(tok), on_block, cfg, progress=False)
spec_q = QuantSpec(bits=4, group_size=64, symmetric=True)
tot = {"old": 0.0, "new": 0.0}
for n, (W, H) in got.items():
    for label, mod in (("old", old_obs), ("new", new_obs)):
        G.obs_column_sweep = mod.obs_column_sweep
        Wq = G.gptq_quantize(W, H.float(), spec_q, act_order=True)[0]
        d = (Wq - W).double(); loss = float(torch.einsum("ij,jk,ik->", d, H, d)); tot[label] += loss
        print(n, label, f"{loss:.6g}")
print(tot, tot["new"] / tot["old"] - 1)
