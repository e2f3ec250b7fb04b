"""Triton kernels for the release's weight formats. Without a CUDA device they run in Triton's interpreter:
the switch is made here, before any submodule lets Triton decorate a kernel."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
