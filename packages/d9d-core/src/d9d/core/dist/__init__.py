"""Topology: parallel degrees, named mesh domains and the distributed context."""

from d9d.core.dist.context import DEFAULT_TIMEOUT, DistributedContext
from d9d.core.dist.degrees import DEGREE_NAMES, MeshDegrees
from d9d.core.dist.domains import DomainLayout, MeshDomain, plan_domains
from d9d.core.dist.environment import LaunchEnvironment, backend_for, moves_cpu_tensors, resolve_device_type
from d9d.core.dist.first_rank import on_first_rank
from d9d.core.dist.rank_logging import RankLoggerAdapter, build_rank_logger

__all__ = [
    "DEFAULT_TIMEOUT",
    "DEGREE_NAMES",
    "DistributedContext",
    "DomainLayout",
    "LaunchEnvironment",
    "MeshDegrees",
    "MeshDomain",
    "RankLoggerAdapter",
    "backend_for",
    "build_rank_logger",
    "moves_cpu_tensors",
    "on_first_rank",
    "plan_domains",
    "resolve_device_type",
]
