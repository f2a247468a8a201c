"""A greedy list scheduler for zero-bubble programs (ZB-H1 and ZBV).

Replays time with uniform costs (forward, input gradient and weight gradient one unit each; the first stage's input
gradient none and its weight gradient two, since that stage's whole backward runs there), or with each stage's
own forward / input-gradient / weight-gradient costs when given (`StageCost`, e.g. from `PipelineCosts`: a heavy
head's input gradient then occupies its rank as long as it will on the GPU). Whenever a rank is free
it starts whichever of its ready input gradients (in micro-batch order per stage) and forwards (while fewer than
`max_alive` forwards await their weight gradient: the activation memory bound) can start earliest, input gradients
first on ties since they unblock the ranks upstream (or forwards first: `greedy_zero_bubble` plans both and keeps the
faster); if none can start right away, a pending weight gradient fills
what would otherwise be bubble. The order each rank ran things in is its program.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from d9d.pipeline.program.actions import Action, ActionKind, F, I, Program, W
from d9d.pipeline.program.communication import insert_communication
from d9d.pipeline.program.layout import StageLayout
from d9d.pipeline.program.replay import ActionCosts, StageCost, replay


@dataclass
class _State:
    layout: StageLayout
    num_microbatches: int
    max_alive: Callable[[int], int]
    reserve_slot: bool = False
    input_priority: int = 0  # 0: input gradients before forwards on ties; 2: after them
    forward_done: dict[tuple[int, int], float] = field(default_factory=dict)
    input_done: dict[tuple[int, int], float] = field(default_factory=dict)
    pending_weights: dict[int, list[Action]] = field(default_factory=dict)
    alive: dict[int, int] = field(default_factory=dict)
    forwards_started: dict[int, int] = field(default_factory=dict)  # per stage: its next forward's micro-batch
    inputs_started: dict[int, int] = field(default_factory=dict)  # per stage: its next input gradient's micro-batch

    def choose(self, rank: int, now: float) -> tuple[float, Action] | None:
        """(ready time, action) of what `rank`, free at `now`, starts next; None if nothing can start now."""
        layout, m = self.layout, self.num_microbatches
        stages = layout.stages_of(rank)
        pending = self.pending_weights.setdefault(rank, [])
        candidates: list[tuple[float, int, int, Action]] = []  # (ready, priority, tie-break, action)
        for stage in stages:
            mb = self.inputs_started.get(stage, 0)
            if mb >= m or (stage, mb) not in self.forward_done:
                continue
            if stage == layout.last_stage:
                candidates.append((self.forward_done[(stage, mb)], self.input_priority, mb, I(stage, mb)))
            elif (stage + 1, mb) in self.input_done:
                # The first stage's I reads nothing from stage 1 (its W does), but placing it after the gradient's
                # arrival costs nothing (it is free) and keeps the receive right before it.
                ready = max(self.forward_done[(stage, mb)], self.input_done[(stage + 1, mb)])
                candidates.append((ready, self.input_priority, mb, I(stage, mb)))
        free = self.max_alive(rank) - self.alive.get(rank, 0)
        if free > 0:
            for stage in stages:
                mb = self.forwards_started.get(stage, 0)
                if mb >= m or (self.reserve_slot and stage != stages[-1] and free < 2):
                    continue  # the last slot stays for a deeper chunk's forward, else its micro-batch cannot finish
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
                self.forwards_started[action.stage] = action.microbatch + 1
                self.alive[rank] = self.alive.get(rank, 0) + 1
            case ActionKind.BACKWARD_INPUT:
                self.input_done[key] = end
                self.inputs_started[action.stage] = action.microbatch + 1
                self.pending_weights.setdefault(rank, []).append(W(*key))
            case _:
                self.pending_weights[rank].remove(action)
                self.alive[rank] -= 1


def greedy_zero_bubble(
    layout: StageLayout,
    num_microbatches: int,
    *,
    max_alive: Callable[[int], int],
    stage_costs: Sequence[StageCost] | None = None,
) -> dict[int, list[Action]]:
    """Per-rank compute orders; `max_alive(rank)` bounds the forwards a rank holds before their weight gradient.

    `stage_costs` (one per global stage) are the durations replayed; None: every action one unit (the first stage's
    `W` two: it is that stage's whole backward). A small portfolio is planned and the order whose program replays
    fastest under those costs is kept (ties: the first planned). Uniform costs try both tie orders (input gradients
    before or after forwards); with costs each is also tried with one slot less (less memory, never more). Which one
    wins depends on the costs (design note 0027).
    """
    if stage_costs is not None and len(stage_costs) != layout.num_stages:
        raise ValueError(
            f"stage_costs has {len(stage_costs)} entries; the layout has {layout.num_stages} global stages "
            f"(pp={layout.pp} x {layout.stages_per_rank}), one StageCost each"
        )
    costs = ActionCosts() if stage_costs is None else ActionCosts(stage_costs=tuple(stage_costs))
    best: tuple[float, dict[int, list[Action]]] | None = None
    for slack in (0,) if stage_costs is None else (0, 1):
        bound = _tightened(max_alive, slack)
        for input_priority in (0, 2):
            try:
                order = _greedy(layout, num_microbatches, bound, stage_costs, input_priority=input_priority)
            except RuntimeError:
                if slack == 0:
                    raise  # the full bound always finishes; a stall there is a bug
                continue  # one slot less can leave no room for a micro-batch to finish: not a candidate
            draft = Program("greedy", layout, num_microbatches, insert_communication(layout, order), training=True)
            makespan = replay(draft, costs).makespan
            if best is None or makespan < best[0] - 1e-9:
                best = (makespan, order)
    assert best is not None
    return best[1]


_UNIT = StageCost(1.0, 1.0, 1.0)  # uniform costs: every action one unit (the first stage's W both halves)


def _tightened(max_alive: Callable[[int], int], slack: int) -> Callable[[int], int]:
    return lambda rank: max(1, max_alive(rank) - slack)


def _greedy(
    layout: StageLayout,
    num_microbatches: int,
    max_alive: Callable[[int], int],
    stage_costs: Sequence[StageCost] | None,
    *,
    input_priority: int,
) -> dict[int, list[Action]]:
    # With uniform costs the order never fills a rank's slots with shallow-chunk forwards; with real costs (a cheap
    # first stage) it can, and then no micro-batch reaches the rank's deeper chunk: the last slot is kept for it.
    state = _State(
        layout, num_microbatches, max_alive, reserve_slot=stage_costs is not None, input_priority=input_priority
    )
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
        clock[rank] = start + (_UNIT if stage_costs is None else stage_costs[action.stage]).of_action(action)
        state.record(rank, action, clock[rank])
        order[rank].append(action)
        remaining -= 1
    return order
