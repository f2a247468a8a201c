"""One `nn.Module` over a rank's stages, with the parameter names of the whole model.

A stage of a catalogue model keeps global names (`model.layers.7.mlp...`, the embedding on the first stage, the head
on the last), so a rank's stages never disagree about a name. Merging their module trees (children united by name,
recursively) gives a view whose `named_parameters()` and `state_dict()` are exactly the whole model's restricted to
this rank: the optimizer, clipping and DCP checkpoints see layout-independent names, and a checkpoint resumes with
another `pp`. The view holds references only; the stages stay the modules that run.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn


def _owns_state(module: nn.Module) -> bool:
    persistent_buffers = [
        name
        for name, buffer in module._buffers.items()
        if buffer is not None and name not in module._non_persistent_buffers_set
    ]
    return any(param is not None for param in module._parameters.values()) or bool(persistent_buffers)


def merge_stage_modules(modules: Sequence[nn.Module], *, path: str = "") -> nn.Module:
    """A module whose children are the union of `modules`' children by name (merged recursively).

    Raises:
        ValueError: two different modules under one name both hold parameters or persistent buffers of their own
            (their names would collide), naming the path.
    """
    distinct = list({id(module): module for module in modules}.values())
    if len(distinct) == 1:
        return distinct[0]
    owners = [module for module in distinct if _owns_state(module)]
    if owners:
        if len(owners) > 1 or any(module._modules for module in distinct):
            raise ValueError(
                f"stages disagree at {path or '<root>'!r}: {len(owners)} of {len(distinct)} modules there hold "
                "parameters of their own, so the merged names would collide; stage modules must use global names"
            )
        return owners[0]
    if not any(module._modules for module in distinct):
        return distinct[0]  # stateless (e.g. RoPE tables): any copy will do for the view
    view = nn.Module()
    names: list[str] = []
    for module in distinct:
        names += [name for name, child in module._modules.items() if child is not None and name not in names]
    for name in names:
        children = [child for module in distinct if (child := module._modules.get(name)) is not None]
        view.add_module(name, merge_stage_modules(children, path=f"{path}.{name}" if path else name))
    return view
