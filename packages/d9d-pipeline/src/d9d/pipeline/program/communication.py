"""Insert sends and receives into per-rank compute orders.

A send goes right after the compute that produced its tensor. A receive goes before the compute that consumes it,
moved earlier where needed so that on every (sender, receiver) channel receives are posted in the order of the
sends: point-to-point messages of one pair of ranks are matched in issue order, not by content.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from d9d.pipeline.program.actions import Action, ActionKind
from d9d.pipeline.program.layout import StageLayout

MessageKey = tuple[str, int, int]  # ("F" | "B", producing stage, micro-batch)


def message_key(action: Action) -> MessageKey:
    """The message a send carries or a receive expects, named by the stage that produced it."""
    match action.kind:
        case ActionKind.SEND_ACTIVATION | ActionKind.SEND_GRADIENT:
            producer = action.stage
        case ActionKind.RECV_ACTIVATION | ActionKind.RECV_GRADIENT:
            producer = action.peer_stage()
        case _:
            raise ValueError(f"{action} is not a communication action")
    direction = "F" if action.kind in (ActionKind.SEND_ACTIVATION, ActionKind.RECV_ACTIVATION) else "B"
    return direction, producer, action.microbatch


def needed_receives(layout: StageLayout, rank: int, action: Action) -> list[Action]:
    """Receives `action` on `rank` consumes (a tensor from a stage on another rank)."""
    match action.kind:
        case ActionKind.FORWARD if action.stage > 0 and layout.rank_of(action.stage - 1) != rank:
            return [Action(action.stage, ActionKind.RECV_ACTIVATION, action.microbatch)]
        case ActionKind.BACKWARD | ActionKind.BACKWARD_INPUT if (
            action.stage < layout.last_stage and layout.rank_of(action.stage + 1) != rank
        ):
            return [Action(action.stage, ActionKind.RECV_GRADIENT, action.microbatch)]
        case _:
            return []


def produced_sends(layout: StageLayout, rank: int, action: Action) -> list[Action]:
    """Sends of what `action` on `rank` produced for a stage on another rank."""
    match action.kind:
        case ActionKind.FORWARD if action.stage < layout.last_stage and layout.rank_of(action.stage + 1) != rank:
            return [Action(action.stage, ActionKind.SEND_ACTIVATION, action.microbatch)]
        case ActionKind.BACKWARD | ActionKind.BACKWARD_INPUT if (
            action.stage > 0 and layout.rank_of(action.stage - 1) != rank
        ):
            return [Action(action.stage, ActionKind.SEND_GRADIENT, action.microbatch)]
        case _:
            return []


def insert_communication(layout: StageLayout, compute: Mapping[int, Sequence[Action]]) -> dict[int, tuple[Action, ...]]:
    """Per-rank programs: `compute` with sends after producers and channel-ordered receives before consumers."""
    send_order: dict[MessageKey, int] = {}
    for rank, actions in compute.items():
        for action in actions:
            for send in produced_sends(layout, rank, action):
                send_order[message_key(send)] = len(send_order)
    programs: dict[int, tuple[Action, ...]] = {}
    for rank, actions in compute.items():
        # channel (source rank) -> [(send position, consumer index, receive)]
        channels: dict[int, list[tuple[float, int, Action]]] = {}
        for index, action in enumerate(actions):
            for recv in needed_receives(layout, rank, action):
                source = layout.rank_of(recv.peer_stage())
                order = send_order.get(message_key(recv), float("inf"))
                channels.setdefault(source, []).append((order, index, recv))
        placed: dict[int, list[tuple[int, float, Action]]] = {}
        for source, receives in channels.items():
            receives.sort(key=lambda item: item[0])
            position = len(actions)
            for order, index, recv in reversed(receives):  # post no later than the next one on this channel
                position = min(position, index)
                placed.setdefault(position, []).append((source, order, recv))
        program: list[Action] = []
        for index, action in enumerate(actions):
            program += [recv for _, _, recv in sorted(placed.get(index, []), key=lambda item: item[:2])]
            program.append(action)
            program += produced_sends(layout, rank, action)
        programs[rank] = tuple(program)
    return programs


def order_pairs(
    layout: StageLayout, compute: Mapping[int, Sequence[Action]], end_times: Mapping[Action, float]
) -> dict[int, tuple[Action, ...]]:
    """Per-rank programs whose point-to-point operations between any two ranks come in one common order on both.

    NCCL runs a pair of ranks' sends and receives, in both directions, on one stream in issue order, so operation `i`
    of rank a with rank b must be operation `i` of rank b with rank a. The common order is the order in which the
    messages are sent in a replay (`end_times`: when each compute ends); sends stay right after their producers,
    receives are posted no later than their consumer and than the next operation of their pair.
    """
    keys: dict[int, list[tuple[float, Action]]] = {rank: [] for rank in compute}
    send_key: dict[MessageKey, tuple[int, float]] = {}  # message -> (sender, program position)
    for rank, actions in compute.items():
        for index, action in enumerate(actions):
            keys[rank].append((float(index), action))
            for offset, send in enumerate(produced_sends(layout, rank, action)):
                position = index + 0.25 + 1e-3 * offset
                keys[rank].append((position, send))
                send_key[message_key(send)] = (rank, position)

    def sent_at(key: MessageKey) -> float:
        direction, stage, mb = key
        kind = ActionKind.FORWARD if direction == "F" else ActionKind.BACKWARD_INPUT
        producer = Action(stage, kind, mb)
        if producer not in end_times:
            producer = Action(stage, ActionKind.BACKWARD, mb)
        return end_times.get(producer, float("inf"))

    for rank, actions in compute.items():
        receives: dict[int, list[tuple[MessageKey, int, Action]]] = {}  # peer -> (message, consumer index, receive)
        for index, action in enumerate(actions):
            for recv in needed_receives(layout, rank, action):
                receives.setdefault(layout.rank_of(recv.peer_stage()), []).append((message_key(recv), index, recv))
        for peer, incoming in receives.items():
            pair: list[tuple[tuple[float, int], MessageKey, int, Action | None]] = [
                ((sent_at(key), peer), key, index, recv) for key, index, recv in incoming
            ]
            pair += [
                ((sent_at(key), rank), key, -1, None)
                for key, (sender, _) in send_key.items()
                if sender == rank and layout.rank_of(key[1] + (1 if key[0] == "F" else -1)) == peer
            ]
            pair.sort(key=lambda item: (item[0], item[1]))
            next_position = float("inf")
            for _, key, index, receive in reversed(pair):
                if receive is None:  # our own send: fixed
                    next_position = send_key[key][1]
                    continue
                next_position = min(index - 0.5, next_position - 1e-6)
                keys[rank].append((next_position, receive))
    return {
        rank: tuple(action for _, action in sorted(items, key=lambda item: item[0])) for rank, items in keys.items()
    }
