"""Build on the meta device, parallelise, then materialise: the life cycle of every d9d model.

A block that owns parameters or buffers implements `reset_parameters()`, which (re)initialises all of them,
including those of the plain `nn.Linear`/`nn.Embedding` children it uses. `materialize_` allocates storage for a
meta-device model and calls `reset_parameters()` on the outermost modules that define it, so each block
initialises its own subtree once and PyTorch's default initialisers of its children never run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from d9d.core.determinism import init_parameter_
from d9d.parallel import to_empty_


@runtime_checkable
class ModuleLateInit(Protocol):
    def reset_parameters(self) -> None: ...


@runtime_checkable
class AdapterLateInit(Protocol):
    """A module put inside a built block (e.g. a PEFT adapter wrapping a block's linear): the block's
    `reset_parameters` initialises the weights it knows, `materialize_` then calls this for the adapter's own."""

    def reset_adapter_parameters(self) -> None: ...


def late_init_roots(module: nn.Module) -> Iterator[nn.Module]:
    """The outermost modules under (and including) `module` that define `reset_parameters`."""
    if isinstance(module, ModuleLateInit):
        yield module
        return
    for child in module.children():
        yield from late_init_roots(child)


def materialize_(module: nn.Module, device: torch.device | str) -> nn.Module:
    """Give every parameter and buffer real storage on `device` and initialise it; returns `module`.

    Works on plain, replicated and FSDP-sharded modules alike: sharded parameters get the values a single process
    would give them (`d9d.core.determinism.init_parameter_`), given the same seed on every rank. The parameters of
    CPU-offloaded FSDP units get CPU storage instead (`d9d.parallel.to_empty_`), where FSDP keeps them.
    """
    to_empty_(module, device)
    for root in late_init_roots(module):
        assert isinstance(root, ModuleLateInit)
        root.reset_parameters()
    for sub in module.modules():
        if isinstance(sub, AdapterLateInit):
            sub.reset_adapter_parameters()
    return module


def init_normal_(tensor: torch.Tensor, std: float) -> None:
    """Normal(0, std) initialisation that a sharded parameter receives exactly as a whole one would."""
    init_parameter_(tensor, _normal(std))


def init_ones_(tensor: torch.Tensor) -> None:
    init_parameter_(tensor, nn.init.ones_)


def init_zeros_(tensor: torch.Tensor) -> None:
    init_parameter_(tensor, nn.init.zeros_)


def _normal(std: float) -> Callable[[torch.Tensor], object]:
    def init(tensor: torch.Tensor) -> object:
        return nn.init.normal_(tensor, mean=0.0, std=std)

    return init
