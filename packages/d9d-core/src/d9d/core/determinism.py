"""Seeding and deterministic initialisation of (possibly sharded) parameters.

The seeding rule: every host RNG (Python `random`, NumPy, torch CPU and CUDA) is seeded with `seed + pp_rank`. All
ranks of one pipeline stage therefore draw the same random stream, which is what DTensor's sharded random ops and
replicated parameters need, while different stages (which own different layers) draw different streams.

Sharded initialisation: `init_parameter_` makes a parameter initialised while sharded equal, bit for bit, the
single-process initialisation, on any mesh and any layout. DTensor's own sharded random ops do not give that: on
CPU meshes (gloo) it has no RNG tracker, so every rank draws its shard from the start of the stream (all shards the
same values), and on CUDA its offset-based Philox tracker is consistent across layouts but measured different from a
single-device draw (tests/core/test_gpu_nccl.py). So by default every rank draws the whole tensor (identical, since
the streams are in sync) and keeps its shard: one full parameter of transient memory at a time, and the same values
whatever the parallel layout, which also makes a run reproducible when it is resumed on another layout.
`layout_independent=False` defers to DTensor's tracker on CUDA for parameters too large to draw whole.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable

import numpy as np
import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from d9d.core.dist.context import DistributedContext


def stage_seed(seed: int, pp_rank: int) -> int:
    """The seed a rank of pipeline stage `pp_rank` uses: `seed + pp_rank`."""
    return seed + pp_rank


def seed_everything(seed: int, ctx: DistributedContext | None = None) -> int:
    """Seed Python, NumPy and torch (CPU and CUDA) per the rule above; returns the seed this rank used."""
    pp_rank = ctx.pp_rank if ctx is not None else 0
    effective = stage_seed(seed, pp_rank)
    random.seed(effective)
    np.random.seed(effective % 2**32)
    torch.manual_seed(effective)  # also seeds every CUDA device, which DTensor's CUDA RNG tracker draws from
    if ctx is not None and ctx.device_type != "cpu":
        _seed_dtensor_rng(effective, ctx)
    return effective


def _seed_dtensor_rng(effective_seed: int, ctx: DistributedContext) -> None:
    """Create DTensor's RNG tracker now, seeded per stage, instead of lazily with rank 0's state everywhere."""
    from torch.distributed.tensor import _random as dtensor_random

    from d9d.core.dist.domains import MeshDomain

    mesh = ctx.mesh_for(MeshDomain.DENSE)
    non_pipeline = mesh["dp_replicate", "dp_cp_shard", "tp"]
    dtensor_random.manual_seed(effective_seed, non_pipeline)


def use_deterministic_algorithms(enabled: bool = True) -> None:
    """Make PyTorch choose deterministic kernels (and fail on ops that have none); slower, for debugging runs."""
    if enabled:
        # cuBLAS needs a fixed workspace to be deterministic; it must be set before the first cuBLAS call.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(enabled)
    torch.backends.cudnn.deterministic = enabled
    torch.backends.cudnn.benchmark = not enabled


def _dtensor_rng_supported(tensor: DTensor) -> bool:
    # Not for CPU-offloaded shards of a CUDA mesh: the tracker draws on the mesh's device.
    return tensor.device_mesh.device_type != "cpu" and tensor.to_local().device.type == tensor.device_mesh.device_type


@torch.no_grad()
def init_parameter_(
    tensor: torch.Tensor, init: Callable[[torch.Tensor], object], *, layout_independent: bool = True
) -> torch.Tensor:
    """Apply an in-place initialiser (e.g. `nn.init.normal_`) so a sharded tensor equals a single-process init.

    Plain tensors are initialised directly; DTensors draw the whole tensor and keep their shard (see the module
    docstring), unless `layout_independent=False` on a mesh where DTensor's RNG tracker works (CUDA).
    """
    if not isinstance(tensor, DTensor) or (not layout_independent and _dtensor_rng_supported(tensor)):
        init(tensor)
        return tensor
    # Drawn on the mesh's device: a CPU-offloaded shard of a CUDA mesh (FSDP's CPU offload) gets the values a run
    # without offload draws from the same seed (the current CUDA device, which the distributed context sets per rank).
    device: torch.device | str = tensor.to_local().device
    if torch.device(device).type != tensor.device_mesh.device_type:
        device = tensor.device_mesh.device_type
    full = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
    init(full)
    # src_data_rank=None: every rank already holds the same full tensor, so slicing needs no communication.
    local = distribute_tensor(full, tensor.device_mesh, tensor.placements, src_data_rank=None).to_local()
    tensor.to_local().copy_(local)
    return tensor
