"""Splitting a plan's groups across ranks, balanced by bytes, identically on every rank."""

from __future__ import annotations

import heapq

from d9d.states.engine.plan import StatePlan
from d9d.states.mapper.api import StateGroup


def assign_groups(plan: StatePlan, world_size: int) -> list[frozenset[StateGroup]]:
    """Each rank's groups: largest first to the least loaded rank (deterministic, so no communication needed)."""
    loads = [(0, rank) for rank in range(world_size)]
    assigned: list[set[StateGroup]] = [set() for _ in range(world_size)]
    ordered = sorted(plan.groups, key=lambda p: (-p.nbytes, min(p.group.inputs)))
    for planned in ordered:
        load, rank = heapq.heappop(loads)
        assigned[rank].add(planned.group)
        heapq.heappush(loads, (load + planned.nbytes, rank))
    return [frozenset(groups) for groups in assigned]
