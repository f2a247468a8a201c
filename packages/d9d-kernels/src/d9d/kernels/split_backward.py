"""Which halves of a split backward a kernel's autograd should compute (input gradients, weight gradients).

A pipeline schedule that splits backward runs autograd twice (input pass, weight pass); a custom autograd function
that computes both halves by hand would do all the work in both. The pipeline package knows the phase, but kernels
never import it: whoever wires the two together registers a provider (d9d-models does, from
`d9d.pipeline.current_backward_phase`). Without one, both halves are computed.
"""

from __future__ import annotations

from collections.abc import Callable

_providers: list[Callable[[], tuple[bool, bool]]] = []


def register_backward_halves(provider: Callable[[], tuple[bool, bool]]) -> None:
    """`provider()` says `(input gradients wanted, weight gradients wanted)` for the backward running now."""
    _providers[:] = [provider]


def wanted_backward_halves() -> tuple[bool, bool]:
    return _providers[0]() if _providers else (True, True)
