"""A greedy list scheduler for zero-bubble programs (used for ZBV).

Replays time with uniform costs (forward, input gradient and weight gradient one unit each): whenever a rank is
free it starts, in this priority, the ready input gradient of the lowest micro-batch (it unblocks the ranks
upstream), else the ready forward of the lowest micro-batch (deepest stage first) while fewer than `max_alive`
stage-activations are held, else a pending weight gradient (which would otherwise be bubble). The order each rank
ran things in is its program.
"""

from __future__ import annotations

from collections.abc import Callable

from d9d.pipeline.program.actions import Action, ActionKind, F, I, W
from d9d.pipeline.program.layout import StageLayout


def greedy_zero_bubble(
    layout: StageLayout, num_microbatches: int, *, max_alive: Callable[[int], int]
) -> dict[int, list[Action]]:
    """Per-rank compute orders; `max_alive(rank)` bounds the forwards a rank holds before their weight gradient."""
    forward_done: dict[tuple[int, int], float] = {}
    input_done: dict[tuple[int, int], float] = {}
    order: dict[int, list[Action]] = {rank: [] for rank in range(layout.pp)}
    clock = dict.fromkeys(range(layout.pp), 0.0)
    pending_weights: dict[int, list[Action]] = {rank: [] for rank in range(layout.pp)}
    alive = dict.fromkeys(range(layout.pp), 0)  # forwards whose weight gradient has not run
    remaining = layout.num_stages * num_microbatches * 3
    while remaining:
        # The rank that can start something earliest acts next (ties: lowest rank).
        best: tuple[float, int, Action] | None = None
        for rank in range(layout.pp):
            choice = _choose(
                layout, rank, num_microbatches, clock[rank], forward_done, input_done, pending_weights, alive, max_alive(rank)
            )
            if choice is None:
                continue
            ready, action = choice
            start = max(clock[rank], ready)
            if best is None or (start, rank) < best[:2]:
                best = (start, rank, action)
        if best is None:
            raise RuntimeError(f"greedy scheduler stuck with {remaining} actions left")  # a bug, not a user error
        start, rank, action = best
        end = start + 1.0
        clock[rank] = end
        key = (action.stage, action.microbatch)
        match action.kind:
            case ActionKind.FORWARD:
                forward_done[key] = end
                alive[rank] += 1
            case ActionKind.BACKWARD_INPUT:
                input_done[key] = end
                pending_weights[rank].append(W(*key))
            case _:
                pending_weights[rank].remove(action)
                alive[rank] -= 1
        order[rank].append(action)
        remaining -= 1
    return order


def _choose(
    layout: StageLayout,
    rank: int,
    m: int,
    now: float,
    forward_done: dict[tuple[int, int], float],
    input_done: dict[tuple[int, int], float],
    pending_weights: dict[int, list[Action]],
    alive: dict[int, int],
    max_alive: int,
) -> tuple[float, Action] | None:
    """(ready time, action) of what `rank`, free at `now`, starts next; None if nothing can ever start now."""
    stages = layout.stages_of(rank)
    candidates: list[tuple[float, int, int, Action]] = []  # (ready, priority, tie-break, action)
    for stage in stages:
        mb = sum(1 for s, _ in input_done if s == stage)  # input gradients of a stage go in micro-batch order
        if mb >= m or (stage, mb) not in forward_done:
            continue
        if stage == layout.last_stage:
            candidates.append((forward_done[(stage, mb)], 0, mb, I(stage, mb)))
        elif (stage + 1, mb) in input_done:
            candidates.append((max(forward_done[(stage, mb)], input_done[(stage + 1, mb)]), 0, mb, I(stage, mb)))
    if alive[rank] < max_alive:
        for stage in stages:
            mb = sum(1 for s, _ in forward_done if s == stage)
            if mb >= m:
                continue
            if stage == 0:
                candidates.append((0.0, 1, -stage, F(stage, mb)))
            elif (stage - 1, mb) in forward_done:
                candidates.append((forward_done[(stage - 1, mb)], 1, -stage, F(stage, mb)))
    if candidates:
        ready, _, _, action = min(candidates, key=lambda item: (max(item[0], now), item[1], item[2]))
        if ready <= now or not pending_weights[rank]:
            return ready, action
    if pending_weights[rank]:
        return now, pending_weights[rank][0]  # a weight gradient fills what would be a bubble
    return None
