"""`acc += a @ b` into a float32 accumulator from compute-dtype (bf16/fp16) matrices, without a separate add.

The weight gradient of the fused loss is a sum over token chunks of `grad_logits.T @ hidden`, each a `(vocab, H)`
tensor-core matmul. Summing them in the compute dtype would round the running sum once per chunk; summing them in
float32 with `acc.add_(a @ b)` costs a `(vocab, H)` product tensor and an elementwise add per chunk (at vocabulary
151,936 x 1024, 5 ms per step on an H100). cuBLAS can instead add the product into a float32 `C` itself (beta = 1),
which `aten::addmm.dtype_out` exposes on CUDA in recent PyTorch (`out_dtype=float32` with bf16/fp16 matrices and a
float32 `self`). Older builds refuse a float32 `self` there and CPU has no kernel for it at all, so the first call per
device type probes the capability (a tiny call, checked on the host: no device synchronisation) and falls back to
the product-then-add. The result is the same float32 sum either way: the product is formed with a float32
accumulator in both, and only the place the add happens differs.
"""

from __future__ import annotations

import torch

_fused_add_supported: dict[str, bool] = {}


def _probe(device: torch.device, dtype: torch.dtype) -> bool:
    acc = torch.zeros(2, 2, dtype=torch.float32, device=device)
    mat = torch.zeros(2, 2, dtype=dtype, device=device)
    try:
        torch.ops.aten.addmm.dtype_out(acc, mat, mat, torch.float32, out=acc)
    except (AttributeError, RuntimeError, NotImplementedError):  # no overload / float32 `self` refused / no kernel
        return False
    return True


def fused_float32_addmm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `addmm_float32_(acc, a, b)` adds inside the matmul for `dtype` matrices on `device`."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return False
    key = f"{device.type}:{dtype}"
    if key not in _fused_add_supported:
        _fused_add_supported[key] = _probe(device, dtype)
    return _fused_add_supported[key]


def addmm_float32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`acc += a @ b` in place, `acc` float32, `a`/`b` of one floating dtype; returns `acc`."""
    if a.dtype == acc.dtype:
        return acc.addmm_(a, b)
    # Traced (the eager backend under torch.compile): no host-side probe inside a graph; the compiler sees the
    # product and the add and may fuse them itself. The Triton backend runs this inside its opaque custom op.
    if not torch.compiler.is_compiling() and fused_float32_addmm_supported(acc.device, a.dtype):
        torch.ops.aten.addmm.dtype_out(acc, a, b, torch.float32, out=acc)
        return acc
    return acc.add_(a @ b)
