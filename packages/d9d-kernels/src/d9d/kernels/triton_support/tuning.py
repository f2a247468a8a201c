"""Autotuning that stays cheap under the interpreter: every config on a GPU, only the first one on CPU."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from d9d.kernels.triton_support.runtime import import_triton, interpreting, next_power_of_2


def autotune(configs: Sequence[Any], key: Sequence[str], *, restore_value: Sequence[str] = ()) -> Callable[[Any], Any]:
    """`triton.autotune(configs, key)`; under `TRITON_INTERPRET=1` only `configs[0]` (timing is meaningless there).

    The configs are the Hopper (sm90) search space; list the one that suits small problems first. A kernel that
    updates a tensor in place must name it in `restore_value`: the tuner runs every config on the same arguments and
    restores those tensors between runs (otherwise the first tuning call would apply the update several times).

    Never key on an extent that changes from call to call (the rows an expert-parallel rank receives, which differ
    every step and layer): each new key value benchmarks every config (Triton's `do_bench`, about 0.1 s each, with
    device syncs). Key on its `size_class` instead."""
    triton = import_triton()
    chosen = list(configs[:1]) if interpreting() else list(configs)
    decorator: Callable[[Any], Any] = triton.autotune(configs=chosen, key=list(key), restore_value=list(restore_value))
    return decorator


def size_class(extent: int) -> int:
    """An autotuning key for a data-dependent extent: `extent` rounded up to a power of two (1 for 0).

    Extents within a factor of two tune once between them, so a kernel whose row count varies from step to step
    (expert parallelism, capacity dropping, packed sequences) tunes a handful of times per run, not every step.
    """
    return next_power_of_2(extent)


def warps_configs(*warps: int) -> list[Any]:
    """One config per `num_warps` value: the whole search space of a row-wise kernel."""
    triton = import_triton()
    return [triton.Config({}, num_warps=count) for count in warps]
