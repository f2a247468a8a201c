"""Mixed precision for parameters that no FSDP unit manages: cast them to the compute dtype for each forward.

FSDP's mixed precision casts a unit's parameters when it all-gathers them. Parameters outside every unit (experts at
efsdp = 1, see `d9d.parallel.placed`) get the same numerics from a forward pre-hook that swaps each parameter for its
`param_dtype` copy for the duration of the module's forward: the copy's backward casts the gradient back to the
parameter's (master) dtype, and autograd accumulates it there, as FSDP's reduce in `reduce_dtype` float32 and its
accumulation into the float32 sharded gradient do. The copy lives until backward (it is saved by the matmuls), which
is what FSDP does at efsdp = 1 too, where it does not reshard after forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class _ComputeDtypeCast:
    """The hooks' state: which attribute of which submodule holds a floating parameter. The parameters themselves are
    looked up at each forward, since materialising a meta-device module may replace the Parameter objects."""

    def __init__(self, module: nn.Module, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.slots: list[tuple[nn.Module, str]] = []
        for name, param in module.named_parameters():
            owner_name, _, attribute = name.rpartition(".")
            if param.dtype != dtype and param.is_floating_point():
                self.slots.append((module.get_submodule(owner_name), attribute))
        self.swapped: list[tuple[nn.Module, str, nn.Parameter]] = []

    def cast(self, module: nn.Module, args: Any) -> None:
        self.restore(module, args, None)  # a forward that never reached its post-hook left nothing behind, but be sure
        for owner, attribute in self.slots:
            param = owner._parameters[attribute]
            if param is None or param.dtype == self.dtype or not isinstance(param, nn.Parameter):
                continue
            self.swapped.append((owner, attribute, param))
            # Bypasses nn.Module.__setattr__, which accepts only Parameters there (as torch.func.functional_call).
            owner._parameters[attribute] = param.to(self.dtype)  # type: ignore[assignment]

    def restore(self, module: nn.Module, args: Any, output: Any) -> None:
        for owner, attribute, param in self.swapped:
            owner._parameters[attribute] = param
        self.swapped.clear()


def cast_parameters_in_forward(module: nn.Module, dtype: torch.dtype | None) -> None:
    """Run `module`'s forward on `dtype` copies of its floating parameters (a no-op for None or parameters already
    in `dtype`); gradients land on the parameters in their own dtype. The parameters are back in place after each
    forward, also one that raised, so state dicts, optimizers and checkpoints only ever see the parameters."""
    if dtype is None:
        return
    hooks = _ComputeDtypeCast(module, dtype)
    if not hooks.slots:
        return
    module.register_forward_pre_hook(hooks.cast)
    module.register_forward_hook(hooks.restore, always_call=True)
