"""Configuration of data parallelism (pydantic, unknown keys rejected) and `build_data_parallel`."""

from __future__ import annotations

from typing import Annotated, Any, Literal, assert_never

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from d9d.parallel.fully_sharded import parallelize_fsdp, parallelize_hsdp
from d9d.parallel.grad_sync import DEFAULT_BUCKET_SIZE_MB, DeferredGradientSynchronizer, GradientSynchronizer
from d9d.parallel.mixed_precision import MixedPrecision
from d9d.parallel.plan import ByName, ByRole, ModuleSelector, select_modules
from d9d.parallel.replicate import parallelize_replicate
from d9d.parallel.single_device import parallelize_single_device
from d9d.parallel.sync import GradientSync, ModuleGradientSync

DTypeName = Literal["float32", "bfloat16", "float16"]

_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_from_name(name: DTypeName | None) -> torch.dtype | None:
    return None if name is None else _DTYPES[name]


class MixedPrecisionConfig(BaseModel):
    """Compute in `param_dtype`, accumulate and reduce gradients in `reduce_dtype`; `None` keeps the dtype."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    param_dtype: DTypeName | None = "bfloat16"
    reduce_dtype: DTypeName | None = "float32"

    def build(self) -> MixedPrecision:
        return MixedPrecision(
            param_dtype=dtype_from_name(self.param_dtype), reduce_dtype=dtype_from_name(self.reduce_dtype)
        )


def _refuse_offload(data: Any, kind: str, instead: str) -> Any:
    """`offload` belongs to the sharded kinds: a clear error for `offload=true` elsewhere (`false` is dropped)."""
    if isinstance(data, dict) and "offload" in data:
        if data["offload"] not in (False, "false", "False", 0):
            raise ValueError(
                f"kind={kind!r} cannot offload (got offload={data['offload']!r}): offload keeps FSDP's parameter "
                f"shards, their gradients and the optimizer state in CPU memory and runs the optimizer step there, "
                f"and kind={kind!r} has no FSDP units; {instead}"
            )
        return {key: value for key, value in data.items() if key != "offload"}
    return data


class ReplicateConfig(BaseModel):
    """Replicate parameters over every dimension of the data-parallel mesh; bucketed all-reduce of gradients."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["replicate"] = "replicate"
    mixed_precision: MixedPrecisionConfig | None = None
    bucket_size_mb: float = Field(default=DEFAULT_BUCKET_SIZE_MB, gt=0)
    grad_dtype: DTypeName | None = Field(
        default=None, description="gradient accumulation and reduction dtype; default: the reduce dtype, else params'"
    )

    @model_validator(mode="before")
    @classmethod
    def _no_offload(cls, data: Any) -> Any:
        return _refuse_offload(data, "replicate", "use kind='fsdp' (or 'hsdp') with offload=true.")


class _ShardedConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    shard_dim: str = "dp_cp_shard"
    units: list[str] = Field(
        default_factory=list, description="name patterns of modules that become their own FSDP unit (e.g. layers.*)"
    )
    unit_roles: list[str] = Field(default_factory=list, description="roles of modules that become their own unit")
    mixed_precision: MixedPrecisionConfig | None = None
    reshard_after_forward: bool = True
    offload: bool = Field(
        default=False,
        description="keep parameter shards, gradients and optimizer state in CPU memory (FSDP2 CPUOffloadPolicy); "
        "the optimizer step runs on the CPU (d9d.parallel.offload)",
    )

    def selectors(self) -> list[ModuleSelector]:
        return [ByName(pattern) for pattern in self.units] + [ByRole(role) for role in self.unit_roles]


class FsdpConfig(_ShardedConfig):
    """Shard parameters over `shard_dim`; every other dimension of the data-parallel mesh must have size 1."""

    kind: Literal["fsdp"] = "fsdp"


class HsdpConfig(_ShardedConfig):
    """Shard parameters over `shard_dim` and replicate them over the other dimension of the data-parallel mesh."""

    kind: Literal["hsdp"] = "hsdp"


class SingleDeviceConfig(BaseModel):
    """One data-parallel rank, no FSDP or replicate machinery: parameters stored in `mixed_precision.param_dtype`,
    gradients accumulated in its `reduce_dtype` (d9d.parallel.single_device). Every data-parallel dimension must
    have size 1."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["single"] = "single"
    mixed_precision: MixedPrecisionConfig | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_offload(cls, data: Any) -> Any:
        return _refuse_offload(
            data, "single", "use kind='fsdp' with offload=true, which runs on one rank too (FSDP over one rank)."
        )


AnyDataParallelConfig = Annotated[
    ReplicateConfig | FsdpConfig | HsdpConfig | SingleDeviceConfig, Field(discriminator="kind")
]


def build_data_parallel(config: AnyDataParallelConfig, module: nn.Module, mesh: DeviceMesh) -> GradientSync:
    """Apply the configured data parallelism to `module` in place; returns what the loop drives per step.

    `mesh` is the data-parallel part of the topology, e.g. `ctx.mesh_for('dense')['dp_replicate', 'dp_cp_shard']`.
    """
    match config:
        case ReplicateConfig():
            parallelize_replicate(module, mesh, mixed_precision=_mixed_precision(config))
            bucket_size_mb, grad_dtype = config.bucket_size_mb, dtype_from_name(config.grad_dtype)
            if any(param.is_meta for param in module.parameters()):
                # built on meta and materialised later: buckets must be allocated beside the real storage
                return DeferredGradientSynchronizer(module, bucket_size_mb=bucket_size_mb, grad_dtype=grad_dtype)
            return GradientSynchronizer.for_module(module, bucket_size_mb=bucket_size_mb, grad_dtype=grad_dtype)
        case FsdpConfig():
            _require_dim(mesh, config.shard_dim, "fsdp")
            others = {name: mesh[name].size() for name in mesh.mesh_dim_names or () if name != config.shard_dim}
            if any(size > 1 for size in others.values()):
                raise ValueError(
                    f"kind='fsdp' shards over {config.shard_dim!r} only, but the data-parallel mesh also has "
                    f"{others}; use kind='hsdp' to replicate over the other dimension."
                )
            shard_mesh = mesh[config.shard_dim]
            for unit in _units(config, module):
                parallelize_fsdp(
                    unit,
                    shard_mesh,
                    mixed_precision=_mixed_precision(config),
                    reshard_after_forward=config.reshard_after_forward,
                    offload=config.offload,
                )
            return ModuleGradientSync(module)
        case SingleDeviceConfig():
            if mesh.size() != 1:
                sizes = dict(zip(mesh.mesh_dim_names or (), mesh.shape, strict=True))
                raise ValueError(
                    f"kind='single' trains one data-parallel rank, but the data-parallel mesh has {mesh.size()} "
                    f"ranks ({sizes}); use kind='fsdp', 'hsdp' or 'replicate'."
                )
            return parallelize_single_device(module, mixed_precision=_mixed_precision(config))
        case HsdpConfig():
            _require_dim(mesh, config.shard_dim, "hsdp")
            for unit in _units(config, module):
                parallelize_hsdp(
                    unit,
                    mesh,
                    shard_dim=config.shard_dim,
                    mixed_precision=_mixed_precision(config),
                    reshard_after_forward=config.reshard_after_forward,
                    offload=config.offload,
                )
            return ModuleGradientSync(module)
        case _:
            assert_never(config)


def _mixed_precision(config: ReplicateConfig | _ShardedConfig | SingleDeviceConfig) -> MixedPrecision | None:
    return config.mixed_precision.build() if config.mixed_precision else None


def _units(config: _ShardedConfig, module: nn.Module) -> list[nn.Module]:
    """The configured units, children before parents, then the root (which takes every parameter left)."""
    units = [unit for _, unit in select_modules(module, config.selectors()) if unit is not module]
    return [*units, module]


def _require_dim(mesh: DeviceMesh, dim: str, kind: str) -> None:
    names = mesh.mesh_dim_names or ()
    if dim not in names:
        raise ValueError(f"kind={kind!r}: shard_dim={dim!r} is not a dimension of the mesh; valid: {', '.join(names)}")
