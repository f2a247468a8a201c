"""Injected failures, for testing that a failed stage resumes without losing finished work.

`D9D_INJECT_FAULT=POINT:AFTER[:TIMES]` makes `check_fault(POINT, n)` raise `InjectedFault` once `n` reaches
AFTER, at most TIMES times in this process (default 1, so a retry of the stage then succeeds). Stages call
`check_fault` after recording each finished piece of work. Unset, it costs one environment lookup.
"""

from __future__ import annotations

import os

FAULT_ENV = "D9D_INJECT_FAULT"
_fired: dict[str, int] = {}


class InjectedFault(RuntimeError):
    """A failure injected through D9D_INJECT_FAULT."""


def check_fault(point: str, count: int) -> None:
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return
    name, _, rest = spec.partition(":")
    if name != point:
        return
    after_text, _, times_text = rest.partition(":")
    try:
        after, times = int(after_text or 1), int(times_text or 1)
    except ValueError as error:
        raise ValueError(f"{FAULT_ENV}={spec!r}: expected POINT:AFTER[:TIMES] with integers") from error
    if count >= after and _fired.get(spec, 0) < times:
        _fired[spec] = _fired.get(spec, 0) + 1
        raise InjectedFault(f"injected failure at {point} after {count} finished pieces ({FAULT_ENV}={spec})")


def reset_faults() -> None:
    """Forget which injected failures already fired (tests call this between runs in one process)."""
    _fired.clear()
