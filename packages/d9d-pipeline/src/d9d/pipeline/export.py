"""Gather a pipelined model's full state on one rank, e.g. to export it in the Hugging Face layout.

Each pipeline rank holds only its stages; their names are the whole model's, so the union of the ranks' state
dicts is the whole model's state dict. Sharded (DTensor) entries are gathered to full tensors first (a collective
over their mesh, which every rank of the stage joins).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def gather_pipeline_state(
    model: nn.Module, group: dist.ProcessGroup | None, *, destination: int = 0
) -> dict[str, torch.Tensor] | None:
    """The whole model's state dict (CPU tensors) on pipeline rank `destination`, None on the others.

    `model` is this rank's view of its stages (`PipelineSchedule.model`). Every rank must call it.

    Raises:
        ValueError: two pipeline ranks hold a tensor of the same name (stages that do not use global names).
    """
    local = {
        name: (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().cpu()
        for name, tensor in model.state_dict().items()
    }
    if group is None:
        return local
    gathered: list[dict[str, torch.Tensor] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, local, group=group)
    if dist.get_rank(group) != destination:
        return None
    merged: dict[str, torch.Tensor] = {}
    for rank, part in enumerate(gathered):
        assert part is not None
        for name, tensor in part.items():
            if name in merged and not torch.equal(merged[name], tensor):
                raise ValueError(
                    f"pipeline rank {rank} holds {name!r} too, with other values; stage names must be global"
                )
            merged[name] = tensor
    return merged
