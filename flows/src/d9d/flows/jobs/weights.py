"""Model directories in and out of the rank programs: d9d-layout safetensors with the model's `parameters.json`.

Loading: the convert stage writes bfloat16 by default while training and evaluation on CPU run in float32; the load
casts each tensor to the module's dtype as it streams (d9d-states checks shapes and names as usual).
Saving: every model directory a stage writes describes itself, so `d9d convert --mapping qwen3-d9d-to-hf DIR HF`
gives a directory `transformers` loads. Pipelined (`degrees.pp > 1`) each rank holds only its stages; the writer
gathers every stage's tensors onto the ranks of pipeline rank 0, which write the one directory.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from d9d.core.dist import DistributedContext, on_first_rank
from d9d.core.dist.domains import MeshDomain
from d9d.models.catalogue import AnyModelParameters, write_parameters
from d9d.pipeline import gather_pipeline_tensors, pipeline_group
from d9d.states import LoadReport, load_model_state, save_model_state
from d9d.states.mapper import CastDtype, Identity, ModelStateMapper, Parallel


def casting_mapper(targets: Mapping[str, torch.Tensor]) -> ModelStateMapper:
    """Each of `targets`' names, cast to its tensor's dtype (integer tensors pass unchanged)."""
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name, tensor in targets.items():
        by_dtype.setdefault(tensor.dtype, []).append(name)
    casts: list[ModelStateMapper] = [
        CastDtype(names, dtype) for dtype, names in by_dtype.items() if dtype.is_floating_point
    ]
    others = [name for dtype, names in by_dtype.items() if not dtype.is_floating_point for name in names]
    if others:
        casts.append(Identity(others))
    return casts[0] if len(casts) == 1 else Parallel(casts)


def load_converted_weights(source: Path, model: nn.Module, *, pipeline_stages: bool = False) -> LoadReport:
    """Every tensor of `model` from `source`, cast to the model's dtypes. `pipeline_stages`: `model` holds some
    pipeline stages of the checkpoint's model (`degrees.pp > 1`), so the other stages' tensors are left unread."""
    return load_model_state(source, model, casting_mapper(model.state_dict()), allow_unused=pipeline_stages)


def first_stage_group(ctx: DistributedContext) -> dist.ProcessGroup:
    """A process group of the ranks whose pipeline coordinate is 0 (every rank must call it: creating a group is
    collective)."""
    ranks: list[int] = ctx.layout_for(MeshDomain.REGULAR).ranks[0].flatten().tolist()  # pp varies slowest
    group: dist.ProcessGroup | None = dist.new_group(ranks)
    assert group is not None
    return group


def save_state_directory(directory: Path, state: Mapping[str, torch.Tensor], ctx: DistributedContext) -> None:
    """Write `state`, this rank's part of a model under global names, as one d9d-layout safetensors directory;
    every rank calls this.

    Without pipeline parallelism `state` names the whole model: DTensors are gathered group by group while the
    ranks write their shares (memory: one group at a time). At `pp > 1` it names this rank's stages only: every
    stage's tensors travel one by one to pipeline rank 0 of each pipeline group (`gather_pipeline_tensors`), and the
    ranks of pipeline coordinate 0 write the directory together while the others wait at a barrier. Memory there:
    the whole `state` in host memory on each rank of pipeline coordinate 0.
    """
    group = pipeline_group(ctx)
    if group is None:
        save_model_state(directory, state, overwrite=True)
        return
    whole = gather_pipeline_tensors(state, group, device=ctx.device)
    writers = first_stage_group(ctx)
    if whole is not None:
        save_model_state(directory, whole, overwrite=True, process_group=writers)
    dist.barrier()  # the directory is complete for every rank once this returns


def save_model_directory(
    directory: Path, state: Mapping[str, torch.Tensor], parameters: AnyModelParameters, ctx: DistributedContext
) -> None:
    """Write `state` (this rank's part of the model, see `save_state_directory`; every rank calls this) as a
    d9d-layout safetensors directory, and its `parameters.json` (the model's kind and shapes) from the main
    process. The directory is complete for every rank once this returns."""
    save_state_directory(directory, state, ctx)
    on_first_rank(lambda: write_parameters(directory, parameters))
