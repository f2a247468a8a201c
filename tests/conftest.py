"""Without a CUDA GPU, the Triton kernels run in Triton's CPU interpreter.

Set here, at the root, because `triton.jit` reads it when a kernel module is imported: a test directory collected
before tests/kernels (models, parallel, pipeline) imports the kernels first."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
