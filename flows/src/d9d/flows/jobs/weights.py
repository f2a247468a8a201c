"""Load a converted checkpoint (d9d layout, safetensors) into a model whose dtypes may differ from the file's.

The convert stage writes bfloat16 by default while training and evaluation on CPU run in float32; the load casts
each tensor to the module's dtype as it streams (d9d-states checks shapes and names as usual).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from d9d.states import LoadReport, load_model_state
from d9d.states.mapper import CastDtype, Identity, ModelStateMapper, Parallel


def load_converted_weights(source: Path, model: nn.Module) -> LoadReport:
    targets = model.state_dict()
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name, tensor in targets.items():
        by_dtype.setdefault(tensor.dtype, []).append(name)
    casts: list[ModelStateMapper] = [
        CastDtype(names, dtype) for dtype, names in by_dtype.items() if dtype.is_floating_point
    ]
    others = [name for dtype, names in by_dtype.items() if not dtype.is_floating_point for name in names]
    if others:
        casts.append(Identity(others))
    mapper = casts[0] if len(casts) == 1 else Parallel(casts)
    return load_model_state(source, model, mapper)
