"""The Hugging Face index of a sharded checkpoint (`model.safetensors.index.json`)."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from d9d.states.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class IndexMetadata(BaseModel):
    # Writers add their own keys (transformers adds `total_parameters`); they are kept, not rejected.
    model_config = ConfigDict(extra="allow")

    total_size: int | None = None


class StateIndex(BaseModel):
    """Which file holds each tensor. Unknown top-level keys are tolerated: indexes in the wild carry a few."""

    model_config = ConfigDict(extra="allow")

    metadata: IndexMetadata = IndexMetadata()
    weight_map: dict[str, str]


def read_index(path: Path) -> StateIndex:
    try:
        return StateIndex.model_validate_json(path.read_bytes())
    except OSError as error:
        raise CheckpointError(f"{path}: cannot be read ({error.strerror or error})") from error
    except ValidationError as error:
        raise CheckpointError(f"{path}: not a valid safetensors index: {error.errors()[0]['msg']}") from error


def index_json(index: StateIndex) -> str:
    payload = index.model_dump(mode="json", exclude_none=True)
    payload["weight_map"] = dict(sorted(index.weight_map.items()))
    return json.dumps(payload, indent=2) + "\n"
