"""Named starting points for a job configuration (`d9d run pipeline --preset NAME`)."""

from __future__ import annotations

import copy
from typing import Any

_PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny": (
        "the main job: 42 Shakespeare works (5 MB), a 4096-token BPE, 2 workers; minutes on a 2-core CPU",
        {
            "workdir": "runs/tiny",
            "data_prep": {
                "corpus": {"kind": "embedded", "name": "shakespeare"},
                "tokenizer": {"kind": "train_bpe", "vocab_size": 4096},
                "validation_fraction": 0.05,
                "workers": 2,
            },
        },
    ),
    "micro": (
        "a smoke test: 4 works, a 512-token BPE, 1 worker; under a minute",
        {
            "workdir": "runs/micro",
            "data_prep": {
                "corpus": {"kind": "embedded", "name": "shakespeare", "limit": 4},
                "tokenizer": {"kind": "train_bpe", "vocab_size": 512},
                "validation_fraction": 0.25,
                "chunk_bytes": 131072,
                "workers": 1,
                "retry_delay_seconds": 0.0,
            },
        },
    ),
}


def preset_names() -> list[str]:
    return sorted(_PRESETS)


def describe_presets() -> str:
    return "\n".join(f"  {name:8} {_PRESETS[name][0]}" for name in preset_names())


def preset(name: str) -> dict[str, Any]:
    """A copy of preset `name` as plain data (the caller may change it)."""
    if name not in _PRESETS:
        raise KeyError(f"unknown preset {name!r}; presets are: {', '.join(preset_names())}")
    return copy.deepcopy(_PRESETS[name][1])
