"""Horizontal parallelism for d9d: replicate, FSDP, HSDP (optionally with CPU offload), expert parallel, exact
gradient-norm clipping, module selection.

Every style is a function on a module and a mesh. Data parallelism reduces gradients by sum; divide the loss by the
step's global token count.
"""

from d9d.parallel.config import (
    AnyDataParallelConfig,
    FsdpConfig,
    HsdpConfig,
    MixedPrecisionConfig,
    ReplicateConfig,
    SingleDeviceConfig,
    build_data_parallel,
)
from d9d.parallel.expert_parallel import check_expert_parallel_degrees, expert_shard_mesh, shard_experts
from d9d.parallel.fully_sharded import parallelize_fsdp, parallelize_hsdp, use_sum_reduction
from d9d.parallel.grad_norm import clip_grad_norm_, total_grad_norm
from d9d.parallel.grad_sync import DeferredGradientSynchronizer, GradientSynchronizer
from d9d.parallel.mixed_precision import BF16_COMPUTE_FP32_REDUCE, MixedPrecision
from d9d.parallel.offload import compute_device, is_cpu_offloaded, offloaded_modules, to_empty_
from d9d.parallel.plan import ByName, ByRole, ModuleSelector, assign_role, roles_of, select_modules
from d9d.parallel.replicate import ReplicateHandle, parallelize_replicate, replicated_parameters
from d9d.parallel.single_device import SingleDeviceGradientSync, cast_parameters_, parallelize_single_device
from d9d.parallel.sync import GradientSync, GradientSyncs, ModuleGradientSync

__all__ = [
    "BF16_COMPUTE_FP32_REDUCE",
    "AnyDataParallelConfig",
    "ByName",
    "ByRole",
    "DeferredGradientSynchronizer",
    "FsdpConfig",
    "GradientSync",
    "GradientSynchronizer",
    "GradientSyncs",
    "HsdpConfig",
    "MixedPrecision",
    "MixedPrecisionConfig",
    "ModuleGradientSync",
    "ModuleSelector",
    "ReplicateConfig",
    "ReplicateHandle",
    "SingleDeviceConfig",
    "SingleDeviceGradientSync",
    "assign_role",
    "build_data_parallel",
    "cast_parameters_",
    "check_expert_parallel_degrees",
    "clip_grad_norm_",
    "compute_device",
    "expert_shard_mesh",
    "is_cpu_offloaded",
    "offloaded_modules",
    "parallelize_fsdp",
    "parallelize_hsdp",
    "parallelize_replicate",
    "parallelize_single_device",
    "replicated_parameters",
    "roles_of",
    "select_modules",
    "shard_experts",
    "to_empty_",
    "total_grad_norm",
    "use_sum_reduction",
]
