"""Present replicated DTensor parameters to forward code as plain local tensors, converted where they are used.

Kernels then see ordinary tensors (no DTensor dispatch, no mixed-tensor errors with plain inputs), and autograd
routes gradients back into the DTensor parameters marked `Partial` over the replicate dimensions, which tells the
gradient synchroniser what to all-reduce.

Mechanism: while a forward runs, each module holding managed parameters has its class swapped for a generated
subclass whose properties of the same names return `param.to_local(grad_placements=...)` (cast to the compute
dtype under mixed precision). Attribute access wins over `nn.Module.__getattr__`, so `self.weight` in any forward
(or in a parent's forward, or in tied-weight code) gets a local tensor, created at the point of use. That point
matters: autograd runs a conversion's backward, and so the parameter's gradient accumulation, right after the
backward of the operation that used it, which lets the synchroniser launch a bucket's all-reduce while backward
continues. Converting every parameter up front would have put all accumulations at the very end of backward.

Outside forward, `module.weight` is the DTensor parameter (so initialisation, `state_dict` and optimizers see
DTensors). A forward pre-hook on every module that holds managed parameters in its subtree activates the subtree
(nested activations are counted), and a forward hook that also runs when forward raises deactivates it; a module
re-run on its own (activation-checkpoint recomputation) therefore activates its subtree itself.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from d9d.core.pytree import tree_map_tensors
from d9d.parallel.replicate.marker import accumulation_placements, managed_names, replicate_info

_DEPTH = "_d9d_local_depth"
_ORIGINAL_CLASS = "_d9d_original_class"


def local_view(module: nn.Module, name: str) -> torch.Tensor | None:
    """The value forward code sees for parameter `name` of `module`: the local tensor of a managed DTensor."""
    param: torch.Tensor | None = module._parameters[name]
    info = replicate_info(module, name)
    if info is None or not isinstance(param, DTensor):
        return param
    local = param.to_local(grad_placements=accumulation_placements(param, info))
    if info.compute_dtype is not None and local.is_floating_point():
        local = local.to(info.compute_dtype)
    return local


_LOCAL_CLASSES: dict[tuple[type[nn.Module], frozenset[str]], type[nn.Module]] = {}


def _local_class(cls: type[nn.Module], names: frozenset[str]) -> type[nn.Module]:
    """`cls` with a property per managed parameter name (one generated class per class and set of names)."""
    key = (cls, names)
    if key not in _LOCAL_CLASSES:
        properties = {name: property(functools.partial(local_view, name=name)) for name in sorted(names)}
        _LOCAL_CLASSES[key] = type(f"Local{cls.__name__}", (cls,), {**properties, "__module__": cls.__module__})
    return _LOCAL_CLASSES[key]


def activate(module: nn.Module) -> None:
    depth = module.__dict__.get(_DEPTH, 0)
    if depth == 0:
        module.__dict__[_ORIGINAL_CLASS] = type(module)
        module.__class__ = _local_class(type(module), managed_names(module))
    module.__dict__[_DEPTH] = depth + 1


def deactivate(module: nn.Module) -> None:
    depth = module.__dict__[_DEPTH] - 1
    module.__dict__[_DEPTH] = depth
    if depth == 0:
        module.__class__ = module.__dict__.pop(_ORIGINAL_CLASS)


def holders(module: nn.Module) -> list[nn.Module]:
    """Modules of `module`'s subtree that hold managed parameters themselves."""
    return [owner for owner in module.modules() if managed_names(owner)]


class LocalParameterScope:
    """Forward hooks of one module: activate every holder of its subtree for the duration of its forward."""

    def __init__(self, *, cast_inputs_to: torch.dtype | None) -> None:
        self.cast_inputs_to = cast_inputs_to
        self.frames: list[list[nn.Module]] = []

    def attach(self, module: nn.Module) -> list[RemovableHandle]:
        return [
            module.register_forward_pre_hook(self.pre_forward, with_kwargs=True),
            # prepend: deactivate before any hook registered earlier (e.g. FSDP's) sees the module after forward.
            module.register_forward_hook(self.post_forward, always_call=True, prepend=True),
        ]

    def pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        active = holders(module)
        for holder in active:
            activate(holder)
        self.frames.append(active)
        if self.cast_inputs_to is None:
            return None
        dtype = self.cast_inputs_to
        cast: tuple[tuple[Any, ...], dict[str, Any]] = tree_map_tensors(
            lambda tensor: tensor.to(dtype) if tensor.is_floating_point() else tensor, (args, kwargs)
        )
        return cast

    def post_forward(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        del module, args, output
        for holder in reversed(self.frames.pop()):
            deactivate(holder)
