"""Autotuning that stays cheap under the interpreter: every config on a GPU, only the first one on CPU."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from d9d.kernels.triton_support.runtime import import_triton, interpreting


def autotune(configs: Sequence[Any], key: Sequence[str], *, restore_value: Sequence[str] = ()) -> Callable[[Any], Any]:
    """`triton.autotune(configs, key)`; under `TRITON_INTERPRET=1` only `configs[0]` (timing is meaningless there).

    The configs are the Hopper (sm90) search space; list the one that suits small problems first. A kernel that
    updates a tensor in place must name it in `restore_value`: the tuner runs every config on the same arguments and
    restores those tensors between runs (otherwise the first tuning call would apply the update several times)."""
    triton = import_triton()
    chosen = list(configs[:1]) if interpreting() else list(configs)
    decorator: Callable[[Any], Any] = triton.autotune(configs=chosen, key=list(key), restore_value=list(restore_value))
    return decorator


def warps_configs(*warps: int) -> list[Any]:
    """One config per `num_warps` value: the whole search space of a row-wise kernel."""
    triton = import_triton()
    return [triton.Config({}, num_warps=count) for count in warps]
