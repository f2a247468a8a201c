"""Shared helpers of the Triton kernel tests: which device they run on, seeded inputs, dtype tolerances."""

import importlib.util

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
requires_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install d9d-kernels[triton])")

# CPU tests run the kernels in Triton's interpreter (conftest.py); GPU runs use the real compiler.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def randn(*shape, seed, dtype=torch.float32, device=DEVICE, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * scale).to(device=device, dtype=dtype)


def close(got, want, dtype, *, fp32=1e-5, bf16=2e-2, msg=""):
    """fp32: the kernels accumulate in float32 like the reference, so only summation order differs (~1e-6
    relative). bf16: outputs are rounded to bfloat16 (2^-8 relative) and the kernels keep float32 where the eager
    reference rounds an intermediate to bfloat16, so they differ by one or two bf16 ulps; Triton's CPU interpreter also
    rounds to bfloat16 by truncation rather than to nearest (another ulp), which 2e-2 covers."""
    tol = fp32 if dtype == torch.float32 else bf16
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol, msg=lambda m: f"{msg}: {m}")
