"""Loading the pretrained base into the injected model: a job checkpoint (DCP) or d9d-layout safetensors."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from d9d.core.checkpoint import MARKER, latest_complete, load_model_weights
from d9d.peft import PeftInjectionResult
from d9d.peft.loading import load_base_state


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


def load_base(path: Path, model: nn.Module, injection: PeftInjectionResult) -> None:
    """Fill every base weight of `model` from `path` (resolved); the adapters keep their initial values."""
    if (path / MARKER).is_file():
        base_names = [name for name in model.state_dict() if name not in injection.adapter_names]
        load_model_weights(path, model, names=base_names)
    else:
        load_base_state(path, model, injection)
