"""A greedy list scheduler for zero-bubble programs (ZB-H1 and ZBV).

Replays time with uniform costs (forward, input gradient and weight gradient one unit each). Whenever a rank is free
it starts whichever of its ready input gradients (in micro-batch order per stage) and forwards (while fewer than
`max_alive` forwards await their weight gradient: the activation memory bound) can start earliest, input gradients
first on ties since they unblock the ranks upstream; if none can start right away, a pending weight gradient fills
what would otherwise be bubble. The order each rank ran things in is its program.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from d9d.pipeline.program.actions import Action, ActionKind, F, I, W
from d9d.pipeline.program.layout import StageLayout


@dataclass
class _State:
    layout: StageLayout
    num_microbatches: int
    max_alive: Callable[[int], int]
    forward_done: dict[tuple[int, int], float] = field(default_factory=dict)
    input_done: dict[tuple[int, int], float] = field(default_factory=dict)
    pending_weights: dict[int, list[Action]] = field(default_factory=dict)
    alive: dict[int, int] = field(default_factory=dict)

    def choose(self, rank: int, now: float) -> tuple[float, Action] | None:
        """(ready time, action) of what `rank`, free at `now`, starts next; None if nothing can start now."""
        layout, m = self.layout, self.num_microbatches
        stages = layout.stages_of(rank)
        pending = self.pending_weights.setdefault(rank, [])
        candidates: list[tuple[float, int, int, Action]] = []  # (ready, priority, tie-break, action)
        for stage in stages:
            mb = sum(1 for s, _ in self.input_done if s == stage)
            if mb >= m or (stage, mb) not in self.forward_done:
                continue
            if stage == layout.last_stage:
                candidates.append((self.forward_done[(stage, mb)], 0, mb, I(stage, mb)))
            elif (stage + 1, mb) in self.input_done:
                ready = max(self.forward_done[(stage, mb)], self.input_done[(stage + 1, mb)])
                candidates.append((ready, 0, mb, I(stage, mb)))
        if self.alive.get(rank, 0) < self.max_alive(rank):
            for stage in stages:
                mb = sum(1 for s, _ in self.forward_done if s == stage)
                if mb >= m:
                    continue
                if stage == 0:
                    candidates.append((0.0, 1, -stage, F(stage, mb)))
                elif (stage - 1, mb) in self.forward_done:
                    candidates.append((self.forward_done[(stage - 1, mb)], 1, -stage, F(stage, mb)))
        if candidates:
            ready, _, _, action = min(candidates, key=lambda item: (max(item[0], now), item[1], item[2]))
            if ready <= now or not pending:
                return ready, action
        if pending:
            return now, pending[0]  # a weight gradient fills what would be a bubble
        return None

    def record(self, rank: int, action: Action, end: float) -> None:
        key = (action.stage, action.microbatch)
        match action.kind:
            case ActionKind.FORWARD:
                self.forward_done[key] = end
                self.alive[rank] = self.alive.get(rank, 0) + 1
            case ActionKind.BACKWARD_INPUT:
                self.input_done[key] = end
                self.pending_weights.setdefault(rank, []).append(W(*key))
            case _:
                self.pending_weights[rank].remove(action)
                self.alive[rank] -= 1


def greedy_zero_bubble(
    layout: StageLayout, num_microbatches: int, *, max_alive: Callable[[int], int]
) -> dict[int, list[Action]]:
    """Per-rank compute orders; `max_alive(rank)` bounds the forwards a rank holds before their weight gradient."""
    state = _State(layout, num_microbatches, max_alive)
    order: dict[int, list[Action]] = {rank: [] for rank in range(layout.pp)}
    clock = dict.fromkeys(range(layout.pp), 0.0)
    remaining = layout.num_stages * num_microbatches * 3
    while remaining:
        # The rank that can start something earliest acts next (ties: the lowest rank).
        best: tuple[float, int, Action] | None = None
        for rank in range(layout.pp):
            choice = state.choose(rank, clock[rank])
            if choice is None:
                continue
            start = max(clock[rank], choice[0])
            if best is None or (start, rank) < best[:2]:
                best = (start, rank, choice[1])
        if best is None:
            raise RuntimeError(f"greedy scheduler stuck with {remaining} actions left")  # a bug, not a user error
        start, rank, action = best
        clock[rank] = start + 1.0
        state.record(rank, action, clock[rank])
        order[rank].append(action)
        remaining -= 1
    return order
