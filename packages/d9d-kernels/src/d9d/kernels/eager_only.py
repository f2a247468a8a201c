"""`eager_only`: `torch.compiler.disable` with its signature kept for the type checker.

For code that must never be traced by Dynamo, such as the expert exchanges, which copy counts to the host and hand
them to collectives as Python lists: traced, those values would become guards, and every new routing would
recompile. Called from compiled code, an `eager_only` function is a graph break and runs eagerly; called eagerly, it
costs a wrapper call (about half a microsecond).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

P = ParamSpec("P")
R = TypeVar("R")


def eager_only(fn: Callable[P, R]) -> Callable[P, R]:
    """`fn`, never compiled (works on methods too)."""
    disabled: Callable[P, R] = torch.compiler.disable(fn)  # type: ignore[no-untyped-call]  # untyped in torch
    return disabled
