"""Model directories in and out of the rank programs: d9d-layout safetensors with the model's `parameters.json`.

Loading: the convert stage writes bfloat16 by default while training and evaluation on CPU run in float32; the load
casts each tensor to the module's dtype as it streams (d9d-states checks shapes and names as usual).
Saving: every model directory a stage writes describes itself, so `d9d convert --mapping qwen3-d9d-to-hf DIR HF`
gives a directory `transformers` loads.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from d9d.core.dist import DistributedContext
from d9d.models.catalogue import AnyModelParameters, write_parameters
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


def save_model_directory(
    directory: Path, state: Mapping[str, torch.Tensor], parameters: AnyModelParameters, ctx: DistributedContext
) -> None:
    """Write `state` (DTensors gathered group by group; every rank calls this) as a d9d-layout safetensors directory,
    and its `parameters.json` (the model's kind and shapes) from the main process."""
    save_model_state(directory, state, overwrite=True)
    if ctx.is_main_process:
        write_parameters(directory, parameters)
