"""The validator: a program set is deadlock-free, pairs every message with its receive and is complete."""

from __future__ import annotations

from d9d.pipeline.program.actions import Program
from d9d.pipeline.program.replay import replay


def validate_program(program: Program) -> None:
    """Raise `ProgramError` naming the rank, action and reason unless `program` runs to completion: no deadlock,
    message `k` of every channel lands in receive `k`, every micro-batch goes forward through every stage once and
    (when training) every gradient is computed exactly once (one `B`, or one `I` then one `W`)."""
    replay(program)
