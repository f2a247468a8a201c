"""Triton support shared by every kernel family: the lazy import, the interpreter switch, device checks.

Nothing here imports Triton at module load; `import_triton()` does, on first use, and turns a missing install into
`BackendUnavailable` naming the extra. With `TRITON_INTERPRET=1` Triton runs its kernels in NumPy on CPU tensors:
the CPU tests use that at small sizes.
"""

from d9d.kernels.triton_support.runtime import (
    any_dtensor,
    check_triton_device,
    import_triton,
    interpreting,
    next_power_of_2,
    reduction_programs,
)

__all__ = [
    "any_dtensor",
    "check_triton_device",
    "import_triton",
    "interpreting",
    "next_power_of_2",
    "reduction_programs",
]
