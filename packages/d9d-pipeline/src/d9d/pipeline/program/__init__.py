"""Pipeline programs: typed actions per rank, the schedule builders, communication insertion, validation and
simulation."""

from d9d.pipeline.program.actions import COMPUTE_KINDS, Action, ActionKind, B, F, I, Program, W
from d9d.pipeline.program.builders import (
    build_program,
    dual_pipe_v,
    gpipe,
    inference,
    interleaved_one_f_one_b,
    one_f_one_b,
    zero_bubble_h1,
    zero_bubble_v,
)
from d9d.pipeline.program.communication import insert_communication
from d9d.pipeline.program.layout import Placement, StageLayout
from d9d.pipeline.program.replay import ActionCosts, ProgramError, StageCost, TimedAction, Timeline, replay
from d9d.pipeline.program.validate import validate_program

__all__ = [
    "COMPUTE_KINDS",
    "Action",
    "ActionCosts",
    "ActionKind",
    "B",
    "F",
    "I",
    "Placement",
    "Program",
    "ProgramError",
    "StageCost",
    "StageLayout",
    "TimedAction",
    "Timeline",
    "W",
    "build_program",
    "dual_pipe_v",
    "gpipe",
    "inference",
    "insert_communication",
    "interleaved_one_f_one_b",
    "one_f_one_b",
    "replay",
    "validate_program",
    "zero_bubble_h1",
    "zero_bubble_v",
]
