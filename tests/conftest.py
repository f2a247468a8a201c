"""Without a CUDA GPU, the Triton kernels run in Triton's CPU interpreter.

Set here, at the root, because `triton.jit` reads it when a kernel module is imported: a test directory collected
before tests/kernels (models, parallel, pipeline) imports the kernels first.

This conftest is imported before the d9d pytest plugin's `pytest_configure`, so it sets the NVML-based CUDA check
itself: the driver-based `torch.cuda.is_available()` would poison every later fork for CUDA, and the GPU tests fork
their NCCL ranks from this process ("Cannot re-initialize CUDA in forked subprocess").
"""

import os

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

import torch  # reads the variable at each call, not at import

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
