"""Triton support shared by every kernel family: the lazy import, the interpreter switch, device checks.

Nothing here imports Triton at module load; `import_triton()` does, on first use, and turns a missing install into
`BackendUnavailable` naming the extra. With `TRITON_INTERPRET=1` Triton runs its kernels in NumPy on CPU tensors:
the CPU tests use that at small sizes. `kernel_op` registers a kernel piece as a custom op whose plain eager calls
skip the dispatcher.
"""

from d9d.kernels.triton_support.kernel_op import KernelOp, kernel_op, kernel_op_calls, set_kernel_op_calls
from d9d.kernels.triton_support.runtime import (
    any_dtensor,
    check_triton_device,
    import_triton,
    interpreting,
    next_power_of_2,
    reduction_programs,
    row_block,
    triton_importable,
)

__all__ = [
    "KernelOp",
    "any_dtensor",
    "check_triton_device",
    "import_triton",
    "interpreting",
    "kernel_op",
    "kernel_op_calls",
    "next_power_of_2",
    "reduction_programs",
    "row_block",
    "set_kernel_op_calls",
    "triton_importable",
]
