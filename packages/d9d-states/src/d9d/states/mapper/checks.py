"""Plan-time consistency checks shared by leaf collections and compositions."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from d9d.states.errors import MappingError, describe_names
from d9d.states.mapper.api import StateGroup


def check_disjoint(groups: Iterable[tuple[str, StateGroup]], *, owner: str) -> None:
    """Fail if two groups read the same name or write the same name.

    `groups` pairs each group with a label of where it comes from (a child mapper), for the message.
    """
    readers: dict[str, tuple[str, StateGroup]] = {}
    writers: dict[str, tuple[str, StateGroup]] = {}
    for label, group in groups:
        for names, seen, verb in ((group.inputs, readers, "read"), (group.outputs, writers, "written")):
            for name in names:
                if name in seen:
                    other_label, other = seen[name]
                    raise MappingError(
                        f"{owner}: {name!r} is {verb} by two groups, {other.describe()} (from {other_label}) and "
                        f"{group.describe()} (from {label}); every name may be {verb} by one group only"
                    )
                seen[name] = (label, group)


def check_names(names: Iterable[str], *, what: str) -> tuple[str, ...]:
    """Names as a tuple, failing on duplicates (a mapping listing a tensor twice is a typo)."""
    result = tuple(names)
    duplicates = {name for name, count in Counter(result).items() if count > 1}
    if duplicates:
        raise MappingError(f"{what}: {describe_names(duplicates)} listed more than once")
    return result
