"""Loading a base checkpoint into an injected model, and saving / loading the fine-tuned part on its own."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from d9d.peft.base import PeftInjectionResult
from d9d.states import CheckpointSource, LoadReport, SaveReport, StateMismatchError, load_model_state, save_model_state
from d9d.states.mapper import Identity, ModelStateMapper


def load_base_state(
    source: Path | str,
    model: nn.Module,
    injection: PeftInjectionResult,
    mapper: ModelStateMapper | None = None,
    *,
    allow_unused: bool = False,
) -> LoadReport:
    """Load a checkpoint of the base model (d9d layout, or any layout through `mapper`, e.g. from HF) into the
    injected `model`: every base name must be filled, only the adapters are left at their initial values.
    `allow_unused`: `model` is part of the checkpoint's model (e.g. this rank's pipeline stages), so checkpoint
    tensors that the mapper does not read are left unread instead of refused."""
    report = load_model_state(
        source, model, mapper or injection.load_state_mapper, strict=False, allow_unused=allow_unused
    )
    expected = len(model.state_dict()) - len(injection.adapter_names)
    if report.tensors != expected:
        raise StateMismatchError(
            f"{source} filled {report.tensors} of the {expected} base tensors of the injected model; a base "
            "checkpoint must hold every name except the adapters"
        )
    return report


def save_trainable_state(destination: Path | str, model: nn.Module, *, overwrite: bool = False) -> SaveReport:
    """Write only the parameters that train (adapters, fully tuned modules) as a d9d-layout safetensors checkpoint.

    Every rank calls it (sharded parameters are gathered group by group)."""
    trainable = {name: param.detach() for name, param in model.named_parameters() if param.requires_grad}
    if not trainable:
        raise ValueError("the model has no trainable parameter to save (was a PEFT method injected?)")
    return save_model_state(destination, trainable, overwrite=overwrite)


def load_trainable_state(source: Path | str, model: nn.Module) -> LoadReport:
    """Load a `save_trainable_state` checkpoint on top of a model that holds the base weights.

    The checkpoint must hold every trainable (`requires_grad`) parameter of `model`: one left out would silently
    stay at its initial value (e.g. adapters saved for q/v loaded into a model with adapters on q/k/v)."""
    names = list(CheckpointSource.open(source).metas())
    trainable = [name for name, param in model.named_parameters() if param.requires_grad]
    missing = sorted(set(trainable) - set(names))
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise StateMismatchError(
            f"{source} lacks {len(missing)} of the model's {len(trainable)} trainable parameters: "
            f"{', '.join(repr(name) for name in missing[:5])}{more}; was it saved from a model with the same PEFT "
            "targets?"
        )
    return load_model_state(source, model, Identity(names), strict=False)
