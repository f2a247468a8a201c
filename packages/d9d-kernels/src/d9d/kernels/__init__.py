"""Triton kernels with plain-PyTorch references, and backend selection for kernel families."""
