"""Parameters placed by an earlier parallelism step that a later data-parallel step must leave alone.

Expert parallelism with one expert-data rank (efsdp = 1) keeps the experts as plain `Shard(0)` DTensors over `ep`
with no FSDP unit of their own (`shard_experts`). The decoder layer around them becomes an FSDP unit on the dense
mesh afterwards; without a mark, FSDP would take the expert parameters into that unit and shard them again over the
dense data ranks. `fully_shard` units built by `d9d.parallel` pass the marked parameters as `ignored_params`.

The mark is kept on the module that owns the parameter, by attribute name, not on the Parameter object:
materialising a meta-device module (`to_empty`) replaces the Parameter objects.
"""

from __future__ import annotations

from torch import nn

_PLACED_ATTRIBUTE = "_d9d_placed_parameters"


def mark_placed(owner: nn.Module, attribute: str, by: str) -> None:
    """Record that step `by` (a short name, for messages) placed `owner`'s parameter `attribute`: data parallelism
    leaves it alone."""
    if attribute not in owner._parameters:
        raise ValueError(f"{type(owner).__name__} has no parameter {attribute!r}; it has {list(owner._parameters)}")
    placed: dict[str, str] = owner.__dict__.setdefault(_PLACED_ATTRIBUTE, {})
    placed[attribute] = by


def placed_by(owner: nn.Module, attribute: str) -> str | None:
    """The step that placed `owner`'s parameter `attribute`, or None for a parameter data parallelism owns."""
    placed: dict[str, str] = owner.__dict__.get(_PLACED_ATTRIBUTE, {})
    return placed.get(attribute)


def placed_parameters(module: nn.Module) -> set[nn.Parameter]:
    """The marked parameters of `module` and its children (as they are now)."""
    found: set[nn.Parameter] = set()
    for sub in module.modules():
        for attribute in sub.__dict__.get(_PLACED_ATTRIBUTE, {}):
            param = sub._parameters.get(attribute)
            if param is not None:
                found.add(param)
    return found
