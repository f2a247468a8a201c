"""Lazy Triton import and the checks every Triton launcher makes before it starts a kernel."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from types import ModuleType

import torch

from d9d.kernels.errors import BackendUnavailable


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (`TRITON_INTERPRET=1`), as the CPU tests do."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def import_triton() -> ModuleType:
    """The `triton` module, or `BackendUnavailable` naming the extra that installs it."""
    try:
        return importlib.import_module("triton")
    except ImportError as error:
        raise BackendUnavailable(
            f"the Triton kernels need the triton package, which is not importable ({error}); install it with "
            "`pip install d9d-kernels[triton]`, or choose kind='eager'"
        ) from error


@functools.cache
def triton_importable() -> bool:
    """Whether the optional `triton` package is installed (found without importing it; cached): for code that
    takes a PyTorch path without it rather than failing, where `import_triton` would raise."""
    return importlib.util.find_spec("triton") is not None


def check_triton_device(*tensors: torch.Tensor) -> None:
    """Triton kernels run on CUDA tensors, or on CPU tensors under the interpreter; anything else is an error."""
    if all(tensor.is_cuda for tensor in tensors):  # the common case, without reading the environment (every launch)
        return
    interpret = interpreting()
    for tensor in tensors:
        if tensor.is_cuda or (interpret and tensor.device.type == "cpu"):
            continue
        raise ValueError(
            f"a Triton kernel got a tensor on {tensor.device}: Triton kernels run on CUDA tensors (or on CPU with "
            "TRITON_INTERPRET=1, for tests); choose kind='eager' for this device"
        )


def any_dtensor(*tensors: torch.Tensor | None) -> bool:
    """True if any tensor is a DTensor: the custom ops take plain tensors (no sharding rules yet), so a block running
    on tensor-parallel DTensors uses the eager reference, which DTensor dispatches op by op."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(tensor, DTensor) for tensor in tensors)


def next_power_of_2(value: int) -> int:
    """Triton block sizes are powers of two: the smallest one at least `value` (1 for 0)."""
    return 1 if value <= 1 else 1 << (value - 1).bit_length()


def row_block(n_cols: int) -> int:
    """The block a row-moving kernel walks a row in: the row's width rounded up to a power of two, at most 4096."""
    return min(next_power_of_2(n_cols), 4096)


def reduction_programs(rows: int, device: torch.device) -> int:
    """How many programs a row-reduction kernel (a weight gradient) splits `rows` over: a few per SM on a GPU (so
    every SM is busy and the float32 partial sums stay small), a handful under the interpreter."""
    if device.type != "cuda":
        return max(1, min(rows, 4))
    index = device.index if device.index is not None else torch.cuda.current_device()
    return max(1, min(rows, _multiprocessors(index) * 4))


@functools.cache
def _multiprocessors(index: int) -> int:
    """The SM count of CUDA device `index` (asked once: `get_device_properties` costs host time on every launch)."""
    return int(torch.cuda.get_device_properties(index).multi_processor_count)
