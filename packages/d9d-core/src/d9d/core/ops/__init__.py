"""Distributed operations that allocate their own outputs: variable-shape tensor gathers and object gathers."""

from d9d.core.ops.objects import all_gather_object, gather_object
from d9d.core.ops.variable_shape import all_gather_variable_shape, gather_variable_shape

__all__ = ["all_gather_object", "all_gather_variable_shape", "gather_object", "gather_variable_shape"]
