"""The mapper graph: declared dependency groups, leaf transforms and their compositions.

from d9d.states import mapper as m

fuse = m.Sequential([
    m.Concatenate(["q.weight", "k.weight", "v.weight"], "qkv.weight"),
    m.Stack([f"experts.{e}.w" for e in range(8)], "experts.w"),
])
"""

from d9d.states.mapper.api import GroupIndex, ModelStateMapper, RegionPlan, StateGroup, Tensors, full_read_plan
from d9d.states.mapper.compose import Graph, Parallel, PrefixScope, RestrictGroups, Sequential
from d9d.states.mapper.leaf import (
    CastDtype,
    Chunk,
    Concatenate,
    Distribute,
    Drop,
    GatherFullTensor,
    Identity,
    Op,
    OpMapper,
    Rename,
    SelectChildModules,
    Squeeze,
    Stack,
    Transpose,
    UnaryOp,
    Unsqueeze,
    Unstack,
    local_box,
)

__all__ = [
    "CastDtype",
    "Chunk",
    "Concatenate",
    "Distribute",
    "Drop",
    "GatherFullTensor",
    "Graph",
    "GroupIndex",
    "Identity",
    "ModelStateMapper",
    "Op",
    "OpMapper",
    "Parallel",
    "PrefixScope",
    "RegionPlan",
    "Rename",
    "RestrictGroups",
    "SelectChildModules",
    "Sequential",
    "Squeeze",
    "Stack",
    "StateGroup",
    "Tensors",
    "Transpose",
    "UnaryOp",
    "Unsqueeze",
    "Unstack",
    "full_read_plan",
    "local_box",
]
