"""Replicate: parameters as `Replicate` DTensors, local tensors inside forward, gradients synchronised separately."""

from d9d.parallel.replicate.api import ReplicateHandle, parallelize_replicate
from d9d.parallel.replicate.marker import ReplicatedParameter, ReplicateInfo, replicate_info, replicated_parameters

__all__ = [
    "ReplicateHandle",
    "ReplicateInfo",
    "ReplicatedParameter",
    "parallelize_replicate",
    "replicate_info",
    "replicated_parameters",
]
