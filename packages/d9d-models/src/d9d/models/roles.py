"""Roles that models declare on their modules, so parallel plans find them without naming classes."""

from __future__ import annotations

import enum
from typing import TypeVar

from torch import nn

from d9d.parallel import assign_role

ModuleT = TypeVar("ModuleT", bound=nn.Module)


class Role(enum.StrEnum):
    EMBEDDING = "embedding"
    ATTENTION = "attention"
    DECODER_LAYER = "decoder_layer"
    LM_HEAD = "lm_head"
    MOE = "moe"
    EXPERTS = "experts"


def with_role(module: ModuleT, *roles: Role) -> ModuleT:
    """Declare `roles` on `module` (see `d9d.parallel.assign_role`) and return it, typed as it was."""
    assign_role(module, *(str(role) for role in roles))
    return module
