"""The validator: a program set is deadlock-free, pairs every message with its receive and is complete."""

from __future__ import annotations

from d9d.pipeline.program.actions import Action, Program
from d9d.pipeline.program.communication import message_key
from d9d.pipeline.program.replay import ProgramError, replay


def validate_program(program: Program) -> None:
    """Raise `ProgramError` naming the rank, action and reason unless `program` runs to completion: no deadlock,
    message `k` of every channel lands in receive `k`, every micro-batch goes forward through every stage once and
    (when training) every gradient is computed exactly once (one `B`, or one `I` then one `W`); and any two ranks
    issue their point-to-point operations with each other in the same order (NCCL runs a pair's operations of both
    directions on one stream in issue order: with that order, a send or receive never waits behind one the other
    rank has not issued yet, so the replay's deadlock freedom carries over)."""
    replay(program)
    check_pair_order(program)


def check_pair_order(program: Program) -> None:
    for a in sorted(program.ranks):
        for b in sorted(program.ranks):
            if b <= a:
                continue
            ours, theirs = _pair_operations(program, a, b), _pair_operations(program, b, a)
            for index, (mine, other) in enumerate(zip(ours, theirs, strict=False)):
                if message_key(mine) != message_key(other) or mine.kind.is_send == other.kind.is_send:
                    raise ProgramError(
                        f"{program.name}: ranks {a} and {b} issue their point-to-point operations in different orders: "
                        f"operation #{index} between them is {mine} on rank {a} but {other} on rank {b} "
                        "(NCCL pairs them in issue order on one stream)"
                    )


def _pair_operations(program: Program, rank: int, peer: int) -> list[Action]:
    layout = program.layout
    return [
        action
        for action in program.ranks[rank]
        if (action.kind.is_send or action.kind.is_recv) and layout.rank_of(action.peer_stage()) == peer
    ]
