"""Gather a pipelined model's full state on one rank, e.g. to export it in the Hugging Face layout.

Each pipeline rank holds only its stages; their names are the whole model's, so the union of the ranks' state
dicts is the whole model's state dict. The tensors travel one at a time: a sharded (DTensor) entry is gathered to a
full tensor first (a collective over its mesh, which every rank of the stage joins at the same entry), then sent
point to point to the destination, which keeps a CPU copy. Peak memory: the whole model in host memory on the
destination, one full tensor on each device.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()


def gather_pipeline_tensors(
    local: Mapping[str, torch.Tensor],
    group: dist.ProcessGroup | None,
    *,
    destination: int = 0,
    device: torch.device | None = None,
) -> dict[str, torch.Tensor] | None:
    """The union of every pipeline rank's `local` tensors (full, on CPU) on pipeline rank `destination` of `group`,
    None on the other ranks; `group=None` (no pipeline): this rank's own tensors.

    `local` is what this rank holds of a model under global names (e.g. its stages' state dict, or only their
    trainable parameters); DTensors are gathered to full tensors. Every rank of the pipeline group, and every rank
    of each stage's data-parallel mesh, must call it (the ranks holding the same stages with the same names).
    `device`: where tensors travel (the group's backend must reach it; default: the device of this rank's first
    tensor). Only the names and shapes go through `all_gather_object`; the tensors go one by one.

    Raises:
        ValueError: two pipeline ranks hold a tensor of the same name with other values (stages that do not use
            global names).
    """
    if group is None:
        return {name: _full(tensor).cpu() for name, tensor in local.items()}
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if device is None:
        device = next(iter(local.values())).device if local else torch.device("cpu")
    metas = {name: (tuple(tensor.shape), tensor.dtype) for name, tensor in local.items()}
    everyone: list[dict[str, tuple[tuple[int, ...], torch.dtype]] | None] = [None] * size
    dist.all_gather_object(everyone, metas, group=group)
    merged: dict[str, torch.Tensor] = {}
    for source, names in enumerate(everyone):
        assert names is not None
        for name, (shape, dtype) in names.items():
            if source == rank:
                tensor = _full(local[name])
                if rank != destination:
                    dist.send(tensor.to(device).contiguous(), group=group, group_dst=destination)
                    continue
                value = tensor.cpu()
            elif rank == destination:
                buffer = torch.empty(shape, dtype=dtype, device=device)
                dist.recv(buffer, group=group, group_src=source)
                value = buffer.cpu()
            else:
                continue
            if name in merged and not torch.equal(merged[name], value):
                raise ValueError(
                    f"pipeline rank {source} holds {name!r} too, with other values; stage names must be global"
                )
            merged[name] = value
    return merged if rank == destination else None


def gather_pipeline_state(
    model: nn.Module, group: dist.ProcessGroup | None, *, destination: int = 0
) -> dict[str, torch.Tensor] | None:
    """The whole model's state dict (CPU tensors) on pipeline rank `destination`, None on the others.

    `model` is this rank's view of its stages (`PipelineSchedule.model`). Every rank must call it; the tensors
    travel one by one (`gather_pipeline_tensors`), so the destination needs the whole model in host memory.

    Raises:
        ValueError: two pipeline ranks hold a tensor of the same name (stages that do not use global names).
    """
    return gather_pipeline_tensors(model.state_dict(), group, destination=destination)
