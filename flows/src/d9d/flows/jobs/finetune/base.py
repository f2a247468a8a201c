"""Loading the base into the injected model: a job checkpoint (DCP), or safetensors in d9d's layout or read through
a named conversion (e.g. a Hugging Face directory with `qwen3-hf-to-d9d`), cast to the model's dtypes as it streams.

Only the base names are asked of a checkpoint: the adapters the PEFT method injected stay at their initial values,
whether the model is sharded (FSDP: every parameter a DTensor) or not.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from d9d.core.checkpoint import MARKER, latest_complete, load_model_weights
from d9d.flows.jobs.weights import casting_mapper
from d9d.models.conversions import named_mapping
from d9d.peft import PeftInjectionResult
from d9d.peft.loading import load_base_state
from d9d.states import CheckpointSource
from d9d.states.mapper import Identity, ModelStateMapper, RestrictGroups, Sequential


def resolve_base(path: Path) -> Path:
    """A complete job checkpoint, the newest complete one under a directory of them, or a safetensors folder."""
    if (path / MARKER).is_file() or any(path.glob("*.safetensors")):
        return path
    latest = latest_complete(path)
    if latest is None:
        raise FileNotFoundError(
            f"base={path}: not a complete job checkpoint, a directory holding one, or a safetensors checkpoint"
        )
    return latest


def load_base(
    path: Path,
    model: nn.Module,
    injection: PeftInjectionResult,
    mapping: str | None = None,
    *,
    pipeline_stages: bool = False,
) -> None:
    """Fill every base weight of `model` from `path` (resolved); the adapters keep their initial values.
    `pipeline_stages`: `model` holds some pipeline stages of the base (`degrees.pp > 1`); only their tensors are
    read."""
    base_names = [name for name in model.state_dict() if name not in injection.adapter_names]
    if (path / MARKER).is_file():
        load_model_weights(path, model, names=base_names)
        return
    source: ModelStateMapper = Identity(base_names)
    if mapping is not None:
        source = named_mapping(mapping).factory(CheckpointSource.open(path).metas())
        if pipeline_stages:
            source = stage_groups(source, set(base_names), mapping)
    targets = model.state_dict()
    mapper = Sequential([source, casting_mapper({n: targets[n] for n in base_names})])
    load_base_state(path, model, injection, mapper, allow_unused=pipeline_stages)


def stage_groups(mapper: ModelStateMapper, names: set[str], mapping: str) -> ModelStateMapper:
    """`mapper` restricted to the groups that produce `names` (this rank's stages).

    Raises:
        ValueError: a group produces names of this rank's stages and of another's (it cannot be split)."""
    groups = []
    for group in mapper.state_dependency_groups():
        mine = group.outputs & names
        if mine and mine != group.outputs:
            raise ValueError(
                f"base_mapping={mapping}: one group makes {sorted(mine)[:3]} of this pipeline rank's stages and "
                f"{sorted(group.outputs - names)[:3]} of another's; it cannot load stage by stage"
            )
        if mine:
            groups.append(group)
    return RestrictGroups(mapper, groups)
