"""Compositions of mappers."""

from d9d.states.mapper.compose.graph import Graph
from d9d.states.mapper.compose.parallel import Parallel
from d9d.states.mapper.compose.prefix import PrefixScope
from d9d.states.mapper.compose.restrict import RestrictGroups
from d9d.states.mapper.compose.sequential import Sequential

__all__ = ["Graph", "Parallel", "PrefixScope", "RestrictGroups", "Sequential"]
