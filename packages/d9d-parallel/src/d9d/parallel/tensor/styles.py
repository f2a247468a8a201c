"""Tensor- and sequence-parallel styles as functions on a module and a 1-D `tp` mesh.

Each style distributes the module's parameters with a placement chosen by the parameter's *name* (not the module's
class), so a wrapper that keeps the base layer's `weight`/`bias` and adds its own parameters (LoRA's `lora_A`,
`lora_B`) is split consistently: the product `x A^T B^T` then needs exactly the collectives of the base layer. The
math of every split op is DTensor's; the hooks only convert the inputs and outputs at the region's edges.

Parameters are split without communication (`src_data_rank=None`): apply the styles to a model built on the meta
device (the d9d life cycle), or to one every rank initialised identically.

Between blocks the activations are `Shard(1)` DTensors (sequence parallel): a region all-gathers its input along
the sequence (`prepare_region_input`), runs column-parallel linears on local tensors, and a row-parallel linear
reduce-scatters its partial output back to `Shard(1)`. Without sequence parallelism (inference: a one-token decode
step cannot be split along the sequence) the activations are `Replicate` DTensors instead: the row-parallel linear
all-reduces (`output=REPLICATED`), norms run replicated (`parallelize_replicated`), and the region entry has nothing
to gather.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)

SEQUENCE = Shard(1)
"""Where the sequence dimension of a `(batch, seq, ...)` activation lives under sequence parallelism."""
REPLICATED = Replicate()
"""Activations between regions without sequence parallelism: every rank holds them whole."""

# A column-parallel linear splits its output features: the parameters on the output side are split by rows.
COLUMN_PLACEMENTS: Mapping[str, Placement] = {"weight": Shard(0), "bias": Shard(0), "lora_B": Shard(0)}
# A row-parallel linear splits its input features: the parameters on the input side are split by columns.
ROW_PLACEMENTS: Mapping[str, Placement] = {"weight": Shard(1), "lora_A": Shard(1)}


def parallelize_column(module: nn.Module, mesh: DeviceMesh) -> None:
    """Split `module` (a linear or a wrapper of one) by output features; input replicated, output a local tensor
    holding this rank's features (e.g. its attention heads). Parameters not named in `COLUMN_PLACEMENTS` are
    replicated."""
    _require_1d(mesh, "parallelize_column")
    distribute_module(
        module,
        mesh,
        partition_fn=_partition_by_name(COLUMN_PLACEMENTS),
        input_fn=_column_input,
        output_fn=_to_local_output,
    )


def parallelize_row(module: nn.Module, mesh: DeviceMesh, *, output: Placement = SEQUENCE) -> None:
    """Split `module` by input features; input a local tensor of this rank's features, output the sum over ranks
    redistributed to `output` (default `Shard(1)`: reduce-scatter along the sequence), as a DTensor."""
    _require_1d(mesh, "parallelize_row")
    distribute_module(
        module,
        mesh,
        partition_fn=_partition_by_name(ROW_PLACEMENTS),
        input_fn=_first_input_as((Shard(-1),)),
        output_fn=_redistribute_output((output,)),
    )


def parallelize_sequence(module: nn.Module, mesh: DeviceMesh, *, dim: int = 1, use_local_output: bool = False) -> None:
    """Replicate `module`'s parameters and run it on activations split along `dim` (norms: elementwise over the
    split dimension). The parameters' gradients come out `Partial` over `tp`; FSDP reduces them."""
    _require_1d(mesh, "parallelize_sequence")
    distribute_module(
        module,
        mesh,
        partition_fn=_partition_by_name({}),
        input_fn=_first_input_as((Shard(dim),)),
        output_fn=_to_local_output if use_local_output else None,
    )


def parallelize_replicated(module: nn.Module, mesh: DeviceMesh) -> None:
    """Replicate `module`'s parameters and run it on whole (`Replicate`) activations: the norms between regions
    without sequence parallelism."""
    _require_1d(mesh, "parallelize_replicated")
    distribute_module(
        module, mesh, partition_fn=_partition_by_name({}), input_fn=_first_input_as((REPLICATED,)), output_fn=None
    )


def prepare_region_input(module: nn.Module, mesh: DeviceMesh) -> None:
    """Gather `module`'s first input along the sequence (`Shard(1) -> Replicate`) and hand it in as a local tensor:
    the entry of a tensor-parallel region (attention, FFN). Its backward reduce-scatters the partial gradients."""
    _require_1d(mesh, "prepare_region_input")
    module.register_forward_pre_hook(lambda _module, args: _gathered_local(args, mesh))


def parallelize_local_region(module: nn.Module, mesh: DeviceMesh, *, placement: Placement = SEQUENCE) -> None:
    """Run `module` on this rank's part of the activations as plain tensors (`placement` in and out; default the
    sequence shard, `REPLICATED`: the whole activations, computed alike on every rank): for blocks whose parameters
    are not tensor-parallel, e.g. an MoE block sharded over `dp x tp` by FSDP."""
    _require_1d(mesh, "parallelize_local_region")
    module.register_forward_pre_hook(lambda _module, args: _placed_local(args, placement))
    module.register_forward_hook(lambda _module, _args, output: _placed_dtensor(output, mesh, placement))


def _require_1d(mesh: DeviceMesh, name: str) -> None:
    if mesh.ndim != 1:
        raise ValueError(
            f"{name} needs the 1-D tp mesh, got dimensions {mesh.mesh_dim_names} of shape {tuple(mesh.shape)}; "
            "pass ctx.mesh_for('dense')['tp']."
        )


def _partition_by_name(placements: Mapping[str, Placement]) -> Any:
    def partition(_name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for param_name, param in list(module.named_parameters(recurse=False)):
            if isinstance(param, DTensor):
                continue  # already distributed (a parameter shared with an already parallelised module)
            placement = placements.get(param_name, Replicate())
            distributed = distribute_tensor(param, mesh, [placement], src_data_rank=None)
            module.register_parameter(param_name, nn.Parameter(distributed, requires_grad=param.requires_grad))

    return partition


def _first_input_as(placements: tuple[Placement, ...]) -> Any:
    def prepare(_module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
        first, rest = inputs[0], inputs[1:]
        if not isinstance(first, torch.Tensor):
            return inputs
        wanted = tuple(_normalized(placement, first.ndim) for placement in placements)
        if isinstance(first, DTensor):
            if tuple(first.placements) != wanted:
                first = first.redistribute(placements=wanted)
        else:
            first = DTensor.from_local(first, mesh, wanted, run_check=False)
        return (first, *rest)

    return prepare


def _column_input(_module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> Any:  # torch types it None
    first, rest = inputs[0], inputs[1:]
    if isinstance(first, DTensor):
        return (first.redistribute(placements=(Replicate(),)), *rest)
    if isinstance(first, torch.Tensor):
        return (_PartialGradReplicate.apply(first, mesh), *rest)  # type: ignore[no-untyped-call]
    return inputs


class _PartialGradReplicate(torch.autograd.Function):
    """A local tensor every rank holds whole, as a `Replicate` DTensor whose gradient comes back unreduced.

    The gradient of a column-parallel linear's input is a sum over the ranks' output features. `DTensor.from_local`
    would all-reduce it here, once per linear (q, k and v: three times); instead each rank's part is handed back as
    is, and the region entry (`prepare_region_input`) reduce-scatters the sum of all of them once.
    """

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, mesh: DeviceMesh) -> DTensor:
        return DTensor.from_local(local, mesh, (Replicate(),), run_check=False)

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple[torch.Tensor, None]:
        if isinstance(grad.placements[0], Partial):
            return grad.to_local(), None
        # Already summed (a compiled backward may reduce it itself): every rank's equal share of the sum.
        full = grad.redistribute(placements=(Replicate(),)).to_local()
        return full / grad.device_mesh.size(), None


def _normalized(placement: Placement, ndim: int) -> Placement:
    if isinstance(placement, Shard) and placement.dim < 0:
        return Shard(placement.dim + ndim)
    return placement


def _to_local_output(_module: nn.Module, output: Any, _mesh: DeviceMesh) -> Any:
    return output.to_local() if isinstance(output, DTensor) else output


def _redistribute_output(placements: tuple[Placement, ...]) -> Any:
    def finish(_module: nn.Module, output: Any, _mesh: DeviceMesh) -> Any:
        if isinstance(output, DTensor) and tuple(output.placements) != placements:
            return output.redistribute(placements=placements)
        return output

    return finish


def _gathered_local(args: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
    first, rest = args[0], args[1:]
    if not isinstance(first, DTensor):
        first = DTensor.from_local(first, mesh, (SEQUENCE,), run_check=False)
    # grad_placements=Partial: each rank's gradient of the gathered input is its part of the sum; the backward of
    # the gather then reduce-scatters it along the sequence.
    return (first.redistribute(placements=(Replicate(),)).to_local(grad_placements=(Partial(),)), *rest)


def _placed_local(args: tuple[Any, ...], placement: Placement) -> tuple[Any, ...]:
    first, rest = args[0], args[1:]
    if isinstance(first, DTensor):
        if tuple(first.placements) != (placement,):
            first = first.redistribute(placements=(placement,))
        first = first.to_local()
    return (first, *rest)


def _placed_dtensor(output: Any, mesh: DeviceMesh, placement: Placement) -> Any:
    if isinstance(output, torch.Tensor) and not isinstance(output, DTensor):
        return DTensor.from_local(output, mesh, (placement,), run_check=False)
    return output
