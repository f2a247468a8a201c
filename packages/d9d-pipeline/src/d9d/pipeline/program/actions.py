"""Typed pipeline actions and per-rank programs.

An action names *what* a rank does to *which* global stage for *which* micro-batch. A program is one ordered tuple
of actions per pipeline rank plus the stage layout it was built for. The executor interprets programs; the
validator and the simulator replay them without a process group.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from d9d.pipeline.program.layout import StageLayout


class ActionKind(enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"  # full backward: input and weight gradients together
    BACKWARD_INPUT = "I"  # input gradient only (zero-bubble split)
    BACKWARD_WEIGHT = "W"  # the deferred weight gradient of an earlier `I`
    SEND_ACTIVATION = "SEND_F"  # stage s -> s+1
    RECV_ACTIVATION = "RECV_F"  # stage s-1 -> s (received by stage s)
    SEND_GRADIENT = "SEND_B"  # stage s -> s-1 (the gradient of stage s's input)
    RECV_GRADIENT = "RECV_B"  # stage s+1 -> s (the gradient of stage s's output)

    @property
    def is_compute(self) -> bool:
        return self in COMPUTE_KINDS

    @property
    def is_send(self) -> bool:
        return self in (ActionKind.SEND_ACTIVATION, ActionKind.SEND_GRADIENT)

    @property
    def is_recv(self) -> bool:
        return self in (ActionKind.RECV_ACTIVATION, ActionKind.RECV_GRADIENT)


COMPUTE_KINDS = frozenset(
    {ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT}
)
_SHORT = {
    ActionKind.FORWARD: "F",
    ActionKind.BACKWARD: "B",
    ActionKind.BACKWARD_INPUT: "I",
    ActionKind.BACKWARD_WEIGHT: "W",
    ActionKind.SEND_ACTIVATION: ">F",
    ActionKind.RECV_ACTIVATION: "<F",
    ActionKind.SEND_GRADIENT: ">B",
    ActionKind.RECV_GRADIENT: "<B",
}


@dataclass(frozen=True, order=True)
class Action:
    """`kind` on global `stage` for `microbatch`. Text form: `2F5` (stage 2, forward, micro-batch 5), `2>F5` a
    send of that activation, `3<F5` its receive by stage 3."""

    stage: int
    kind: ActionKind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{_SHORT[self.kind]}{self.microbatch}"

    def __repr__(self) -> str:
        return str(self)

    def peer_stage(self) -> int:
        """The stage on the other end of a send or receive."""
        match self.kind:
            case ActionKind.SEND_ACTIVATION | ActionKind.RECV_GRADIENT:
                return self.stage + 1
            case ActionKind.RECV_ACTIVATION | ActionKind.SEND_GRADIENT:
                return self.stage - 1
            case _:
                raise ValueError(f"{self} is not a communication action")


def F(stage: int, microbatch: int) -> Action:  # noqa: N802 - the schedule-paper letters read best
    return Action(stage, ActionKind.FORWARD, microbatch)


def B(stage: int, microbatch: int) -> Action:  # noqa: N802
    return Action(stage, ActionKind.BACKWARD, microbatch)


def I(stage: int, microbatch: int) -> Action:  # noqa: E743, N802
    return Action(stage, ActionKind.BACKWARD_INPUT, microbatch)


def W(stage: int, microbatch: int) -> Action:  # noqa: N802
    return Action(stage, ActionKind.BACKWARD_WEIGHT, microbatch)


@dataclass(frozen=True)
class Program:
    """One ordered action tuple per pipeline rank, for `num_microbatches` micro-batches on `layout`."""

    name: str
    layout: StageLayout
    num_microbatches: int
    ranks: Mapping[int, tuple[Action, ...]]
    training: bool = True

    def for_rank(self, rank: int) -> tuple[Action, ...]:
        return self.ranks[rank]

    def describe(self) -> str:
        """One line per rank in the text form, e.g. `rank 0: 0F0 0>F0 0F1 ...`."""
        return "\n".join(f"rank {rank}: {' '.join(map(str, actions))}" for rank, actions in sorted(self.ranks.items()))
