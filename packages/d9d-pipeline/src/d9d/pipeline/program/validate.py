"""The validator: a program set is deadlock-free, pairs every message with its receive and is complete.

What it proves is tied to how the executor communicates (runtime/p2p.py, design note 0026): every channel (sender
rank -> receiver rank) has its own communicator, whose operations run in issue order, and a communicator is created
on its channel's first message by both ends together. Under those rules, operation `k` of a channel can finish once
both ends have issued it, since operation `k - 1` of the channel was issued before it on both ends; an operation
never waits for another channel's. That is what the replay models: sends and receives are posted without blocking,
a compute waits until the receive it consumes is matched by its send, and a channel's first operation waits until
the other end reaches its own first operation on that channel.
"""

from __future__ import annotations

from d9d.pipeline.program.actions import Action, Program
from d9d.pipeline.program.communication import message_key
from d9d.pipeline.program.replay import ProgramError, replay


def validate_program(program: Program) -> None:
    """Raise `ProgramError` naming the rank, action and reason unless `program` runs to completion: on every channel
    the receiver posts its receives in the order the sender sends (message `k` lands in receive `k`), no deadlock,
    every micro-batch goes forward through every stage once and (when training) every gradient is computed exactly
    once (one `B`, or one `I` then one `W`)."""
    check_channel_order(program)
    replay(program)


def check_channel_order(program: Program) -> None:
    """Raise `ProgramError` unless, on every channel whose sends and receives are equal in number, receive `k` of the
    receiver expects message `k` of the sender. (A message without its receive, or a receive without its message, is
    left to the replay, which names the compute that misses it.)"""
    layout = program.layout
    for rank, actions in sorted(program.ranks.items()):
        for action in actions:
            if not (action.kind.is_send or action.kind.is_recv):
                continue
            if not 0 <= action.peer_stage() < layout.num_stages:
                raise ProgramError(
                    f"{program.name}: rank {rank}, action {action}: stage {action.peer_stage()} (its other end) is "
                    f"outside the {layout.num_stages} stages"
                )
            if layout.rank_of(action.stage) != rank:
                raise ProgramError(
                    f"{program.name}: rank {rank}, action {action}: stage {action.stage} lives on rank "
                    f"{layout.rank_of(action.stage)}"
                )
    for sender in sorted(program.ranks):
        for receiver in sorted(program.ranks):
            if receiver == sender:
                continue
            sends = _channel_operations(program, sender, receiver, sending=True)
            receives = _channel_operations(program, receiver, sender, sending=False)
            if len(sends) != len(receives):
                continue
            for index, (send, receive) in enumerate(zip(sends, receives, strict=True)):
                if message_key(send) != message_key(receive):
                    raise ProgramError(
                        f"{program.name}: channel rank {sender} -> rank {receiver}: message #{index} is {send} but "
                        f"receive #{index} is {receive} (a channel's messages land in its receives in issue order)"
                    )


def _channel_operations(program: Program, rank: int, peer: int, *, sending: bool) -> list[Action]:
    """`rank`'s sends to `peer` (`sending`) or its receives from `peer`, in program order."""
    layout = program.layout
    return [
        action
        for action in program.ranks[rank]
        if (action.kind.is_send if sending else action.kind.is_recv) and layout.rank_of(action.peer_stage()) == peer
    ]
