"""Schedule builders: the compute order of every rank; `build_program` adds communication and validates.

Notation: `p` pipeline ranks, `m` micro-batches, `v` stages per rank. Every builder returns, per rank, the order in
which that rank runs forwards (`F`), full backwards (`B`) or split backwards (`I` then `W`) of its stages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from d9d.pipeline.program.actions import Action, B, F, I, Program, W
from d9d.pipeline.program.communication import insert_communication
from d9d.pipeline.program.greedy import greedy_zero_bubble
from d9d.pipeline.program.layout import Placement, StageLayout
from d9d.pipeline.program.replay import StageCost
from d9d.pipeline.program.validate import validate_program

ComputeOrder = dict[int, list[Action]]


def gpipe(p: int, m: int) -> tuple[StageLayout, ComputeOrder]:
    """All forwards, then all backwards: `p - 1` slots of bubble at each end, `m` activations alive."""
    return StageLayout(p), {r: [F(r, i) for i in range(m)] + [B(r, i) for i in range(m)] for r in range(p)}


def one_f_one_b(p: int, m: int) -> tuple[StageLayout, ComputeOrder]:
    """Rank `r` runs `p - 1 - r` warm-up forwards, then alternates forward and backward, then drains."""
    order: ComputeOrder = {}
    for r in range(p):
        warmup = min(p - 1 - r, m)
        actions = [F(r, i) for i in range(warmup)]
        for i in range(m - warmup):
            actions += [F(r, warmup + i), B(r, i)]
        actions += [B(r, i) for i in range(m - warmup, m)]
        order[r] = actions
    return StageLayout(p), order


def interleaved_one_f_one_b(p: int, m: int, v: int) -> tuple[StageLayout, ComputeOrder]:
    """Megatron's interleaved (looped) 1F1B: rank `r` holds stages `r, r+p, ...`; micro-batches go through a rank's
    chunks in rounds of `p`. Needs `m % p == 0`."""
    layout = StageLayout(p, v)
    total = m * v

    def forward_at(r: int, k: int) -> Action:
        chunk = (k // p) % v
        return F(chunk * p + r, (k // (p * v)) * p + k % p)

    def backward_at(r: int, k: int) -> Action:
        chunk = v - 1 - (k // p) % v
        return B(chunk * p + r, (k // (p * v)) * p + k % p)

    order: ComputeOrder = {}
    for r in range(p):
        warmup = min((p - r - 1) * 2 + (v - 1) * p, total)
        actions = [forward_at(r, k) for k in range(warmup)]
        for k in range(total - warmup):
            actions += [forward_at(r, warmup + k), backward_at(r, k)]
        actions += [backward_at(r, k) for k in range(total - warmup, total)]
        order[r] = actions
    return layout, order


def zero_bubble_h1(
    p: int, m: int, stage_costs: Sequence[StageCost] | None = None, *, activation_memory: float = 1.0
) -> tuple[StageLayout, ComputeOrder]:
    """ZB-H1: 1F1B's peak memory (no rank holds more than `p` micro-batches' activations) with the backward split into
    `I` and `W`; weight gradients fill what would be 1F1B's bubbles (greedy order, see `greedy`). `stage_costs`: one
    per stage, the durations the greedy order is planned with (None: uniform). `activation_memory` scales the bound
    (2.0: ZB-2p's trade of twice the activations for fewer bubbles; design note 0030)."""
    layout = StageLayout(p)
    bound = activation_bound(p, activation_memory)
    return layout, greedy_zero_bubble(layout, m, max_alive=lambda _rank: bound, stage_costs=stage_costs)


def zero_bubble_v(
    p: int, m: int, stage_costs: Sequence[StageCost] | None = None, *, activation_memory: float = 1.0
) -> tuple[StageLayout, ComputeOrder]:
    """ZBV: two stages per rank in a V (rank `r` holds `r` and `2p-1-r`), split backward, greedy zero-bubble order
    with at most `2p` stage-activations alive per rank (the memory of 1F1B) times `activation_memory`.
    `stage_costs` as for ZB-H1."""
    layout = StageLayout(p, 2, Placement.V)
    bound = activation_bound(2 * p, activation_memory)
    return layout, greedy_zero_bubble(layout, m, max_alive=lambda _rank: bound, stage_costs=stage_costs)


def activation_bound(base: int, activation_memory: float) -> int:
    """The forwards a rank may hold before their weight gradients: `base` (1F1B's memory) times `activation_memory`,
    rounded down, never below `base`."""
    if not activation_memory >= 1.0 or activation_memory == float("inf"):
        raise ValueError(f"activation_memory={activation_memory} must be a finite factor of at least 1.0")
    return max(base, int(base * activation_memory))


class _DualPipeVRank:
    """The compute order of one DualPipeV rank, written as its phases (chunk 0 = stage r, chunk 1 = 2p-1-r)."""

    def __init__(self, p: int, r: int) -> None:
        self.stages = (r, 2 * p - 1 - r)
        self.next_forward = [0, 0]
        self.next_backward = [0, 0]
        self.deferred: list[Action] = []
        self.actions: list[Action] = []

    def forward(self, chunk: int) -> None:
        self.actions.append(F(self.stages[chunk], self.next_forward[chunk]))
        self.next_forward[chunk] += 1

    def backward(self, chunk: int, *, zero_bubble: bool = False) -> None:
        stage, mb = self.stages[chunk], self.next_backward[chunk]
        self.next_backward[chunk] += 1
        if zero_bubble:
            self.actions.append(I(stage, mb))
            self.deferred.append(W(stage, mb))
        else:
            self.actions.append(B(stage, mb))

    def weight(self) -> None:
        self.actions.append(self.deferred.pop(0))


def dual_pipe_v(p: int, m: int) -> tuple[StageLayout, ComputeOrder]:
    """DualPipeV (DeepSeek): V layout; forward/backward pairs of the two chunks in the steady state, zero-bubble
    (`I` now, `W` later) backwards in the ramps. Chunk 0 of rank `r` is stage `r`, chunk 1 is stage `2p-1-r`.
    Needs `m >= 2p`."""
    layout = StageLayout(p, 2, Placement.V)
    order: ComputeOrder = {}
    for r in range(p):
        rank = _DualPipeVRank(p, r)
        for _ in range((p - r - 1) * 2):  # 1: warm-up forwards of chunk 0
            rank.forward(0)
        for _ in range(r + 1):  # 2: forward pairs
            rank.forward(0)
            rank.forward(1)
        for _ in range(p - r - 1):  # 3: zero-bubble backward of chunk 1, its weight, a forward of chunk 1
            rank.backward(1, zero_bubble=True)
            rank.weight()
            rank.forward(1)
        for _ in range(m - 2 * p + r + 1):  # 4: the steady state, F0+B1 then F1+B0
            rank.forward(0)
            rank.backward(1)
            rank.forward(1)
            rank.backward(0)
        for _ in range(p - r - 1):  # 5: B1, then F1+B0
            rank.backward(1)
            rank.forward(1)
            rank.backward(0)
        zero_bubble = False
        for i in range(r + 1):  # 6: B1 B0, the second half zero-bubble
            if i == (r + 1) // 2 and r % 2 == 1:
                zero_bubble = True
            rank.backward(1, zero_bubble=zero_bubble)
            if i == (r + 1) // 2 and r % 2 == 0:
                zero_bubble = True
            rank.backward(0, zero_bubble=zero_bubble)
        for _ in range(p - r - 1):  # 7: W then a zero-bubble B0
            rank.weight()
            rank.backward(0, zero_bubble=True)
        while rank.deferred:  # 8: the remaining weight gradients
            rank.weight()
        order[r] = rank.actions
    return layout, order


def inference(layout: StageLayout, m: int) -> tuple[StageLayout, ComputeOrder]:
    """Forward only, for any layout: each micro-batch goes through the stages in order."""
    order: ComputeOrder = {r: [] for r in range(layout.pp)}
    for i in range(m):
        for stage in range(layout.num_stages):
            order[layout.rank_of(stage)].append(F(stage, i))
    return layout, order


def build_program(
    name: str, builder: Callable[[], tuple[StageLayout, ComputeOrder]], num_microbatches: int, *, training: bool = True
) -> Program:
    """Run `builder`, insert the communication, validate (raises `ProgramError` with the reason) and return.

    Sends go right after their producers, receives before their consumers in the order of their channel's sends
    (`insert_communication`). Operations of different channels are not ordered against each other: the executor
    runs each channel (sender rank -> receiver rank) on its own communicator (design note 0026)."""
    layout, order = builder()
    program = Program(name, layout, num_microbatches, insert_communication(layout, order), training)
    validate_program(program)
    return program
