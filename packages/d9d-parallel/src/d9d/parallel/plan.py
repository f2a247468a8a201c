"""Finding the modules a parallel plan applies to: by fully-qualified name or by declared role, never by class.

Matching by class would miss a module once an adapter (LoRA) or another wrapper replaces it; a name still points
at the same place in the tree, and a role travels with whoever copies it onto the wrapper.

Name patterns are matched segment by segment on the dotted module name: `*` matches within one segment
(`layers.*` is every direct child of `layers`), `**` matches any number of segments (`**.mlp` is every `mlp`),
and `[]`/`?` work as in `fnmatch`.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from torch import nn

ROLE_ATTRIBUTE = "d9d_parallel_roles"


@dataclass(frozen=True)
class ByName:
    """Modules whose fully-qualified name matches `pattern` (see the module docstring for the syntax)."""

    pattern: str


@dataclass(frozen=True)
class ByRole:
    """Modules that declared `role` with `assign_role` (e.g. 'block', 'embedding', 'head')."""

    role: str


ModuleSelector = ByName | ByRole


def assign_role(module: nn.Module, *roles: str) -> nn.Module:
    """Declare roles on a module instance (kept beside any roles it already has); returns the module."""
    setattr(module, ROLE_ATTRIBUTE, roles_of(module) | frozenset(roles))
    return module


def roles_of(module: nn.Module) -> frozenset[str]:
    roles: object = getattr(module, ROLE_ATTRIBUTE, frozenset())
    return roles if isinstance(roles, frozenset) else frozenset()


def name_matches(pattern: str, name: str) -> bool:
    return _match_segments(pattern.split(".") if pattern else [], name.split(".") if name else [])


def _match_segments(pattern: list[str], name: list[str]) -> bool:
    if not pattern:
        return not name
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        return any(_match_segments(rest, name[skip:]) for skip in range(len(name) + 1))
    return bool(name) and fnmatch.fnmatchcase(name[0], head) and _match_segments(rest, name[1:])


def matches(selector: ModuleSelector, name: str, module: nn.Module) -> bool:
    match selector:
        case ByName(pattern=pattern):
            return name_matches(pattern, name)
        case ByRole(role=role):
            return role in roles_of(module)


def select_modules(root: nn.Module, selectors: list[ModuleSelector]) -> list[tuple[str, nn.Module]]:
    """Every module under `root` (root itself is named '') that any selector matches, children before parents.

    Children first is the order wrapping functions such as `fully_shard` need: a unit is wrapped before the unit
    that contains it.
    """
    found = [
        (name, module)
        for name, module in root.named_modules()
        if any(matches(selector, name, module) for selector in selectors)
    ]
    return sorted(found, key=lambda item: -_depth(item[0]))


def _depth(name: str) -> int:
    return 0 if not name else name.count(".") + 1
