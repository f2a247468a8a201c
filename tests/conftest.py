"""Without a CUDA GPU, the Triton kernels run in Triton's CPU interpreter.

Set here, at the root, because `triton.jit` reads it when a kernel module is imported: a test directory collected
before tests/kernels (models, parallel, pipeline) imports the kernels first.

This conftest is imported before the d9d pytest plugin's `pytest_configure`, so it sets the NVML-based CUDA check
itself: the driver-based `torch.cuda.is_available()` would poison every later fork for CUDA, and the GPU tests fork
their NCCL ranks from this process ("Cannot re-initialize CUDA in forked subprocess").

A test session started in the background (`nohup pytest ... &`) inherits SIGINT ignored, and an ignored signal stays
ignored across exec: the tests that Ctrl-C a `d9d` process would wait for a command that never hears it. A handled
signal is reset to the default on exec, so the session handles it (as Python does when it starts in the foreground).
"""

import os
import signal

if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

import torch  # reads the variable at each call, not at import

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
