"""Selecting modules by a full-match regular expression on their qualified names."""

from __future__ import annotations

import re

from torch import nn


def matching_modules(module: nn.Module, pattern: re.Pattern[str], *, method: str) -> list[tuple[str, nn.Module]]:
    """Every `(name, module)` whose qualified name fully matches `pattern`.

    Raises:
        ValueError: nothing matches (the message shows some of the names there are).
    """
    found = [(name, sub) for name, sub in module.named_modules() if name and pattern.fullmatch(name)]
    if not found:
        names = [name for name, _ in module.named_modules() if name]
        shown = ", ".join(names[:12]) + (f", ... ({len(names)} in all)" if len(names) > 12 else "")
        raise ValueError(
            f"{method}: module_name_pattern={pattern.pattern!r} fully matches no module name; names look like: {shown}"
        )
    return found


def replace_module(root: nn.Module, name: str, replacement: nn.Module) -> None:
    """Put `replacement` where `name` is. Public instance attributes the replacement lacks (e.g. the roles parallel
    plans find modules by) carry over, so a wrapped module is parallelised as the original would be."""
    original = root.get_submodule(name)
    for attribute, value in vars(original).items():
        if not attribute.startswith("_") and attribute not in vars(replacement):
            setattr(replacement, attribute, value)
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, replacement)
