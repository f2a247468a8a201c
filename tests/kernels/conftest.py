"""Without a CUDA GPU, the Triton kernels run in Triton's CPU interpreter (set before any kernel is compiled)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
