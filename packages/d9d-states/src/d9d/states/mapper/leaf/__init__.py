"""Leaf mappers: the atomic transforms."""

from d9d.states.mapper.leaf.cast import CastDtype
from d9d.states.mapper.leaf.concat import Chunk, Concatenate
from d9d.states.mapper.leaf.dtensor import Distribute, GatherFullTensor, local_box
from d9d.states.mapper.leaf.op import Op, OpMapper, UnaryOp
from d9d.states.mapper.leaf.rename import Drop, Identity, Rename, SelectChildModules
from d9d.states.mapper.leaf.shape import Squeeze, Transpose, Unsqueeze
from d9d.states.mapper.leaf.stack import Stack, Unstack

__all__ = [
    "CastDtype",
    "Chunk",
    "Concatenate",
    "Distribute",
    "Drop",
    "GatherFullTensor",
    "Identity",
    "Op",
    "OpMapper",
    "Rename",
    "SelectChildModules",
    "Squeeze",
    "Stack",
    "Transpose",
    "UnaryOp",
    "Unsqueeze",
    "Unstack",
    "local_box",
]
