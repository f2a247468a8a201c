"""Parameters placed by an earlier parallelism step that a later data-parallel step must leave alone.

Expert parallelism with one expert-data rank (efsdp = 1) keeps the experts as plain `Shard(0)` DTensors over `ep`
with no FSDP unit of their own (`shard_experts`). The decoder layer around them becomes an FSDP unit on the dense
mesh afterwards; without a mark, FSDP would take the expert parameters into that unit and shard them again over the
dense data ranks. `fully_shard` units built by `d9d.parallel` pass the marked parameters as `ignored_params`.
"""

from __future__ import annotations

from torch import nn

_PLACED_ATTRIBUTE = "_d9d_placed_by"


def mark_placed(param: nn.Parameter, by: str) -> None:
    """Record that `by` (a short name of the step, for error messages) placed `param`: data parallelism skips it."""
    setattr(param, _PLACED_ATTRIBUTE, by)


def placed_by(param: nn.Parameter) -> str | None:
    """The step that placed `param`, or None for a parameter data parallelism owns."""
    by = getattr(param, _PLACED_ATTRIBUTE, None)
    return by if isinstance(by, str) else None


def placed_parameters(module: nn.Module) -> set[nn.Parameter]:
    """The marked parameters of `module` and its children."""
    return {param for param in module.parameters() if placed_by(param) is not None}
