"""Capture and restore every host RNG a rank uses (Python, NumPy, torch CPU and CUDA), as plain JSON.

The state is numbers and base64 strings only, so reading it back never unpickles anything: a checkpoint file
someone swapped for a pickle is refused as malformed instead of being executed.
"""

from __future__ import annotations

import base64
import random
from typing import Any

import numpy as np
import torch

RNG_FORMAT = 1


class RngStateError(ValueError):
    """A stored RNG state is malformed (not the JSON `capture_rng_state` writes)."""


def capture_rng_state() -> dict[str, Any]:
    """Every RNG's state as a JSON-serialisable mapping."""
    version, python_state, gauss = random.getstate()
    kind, keys, position, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "format": RNG_FORMAT,
        "python": {"version": version, "state": list(python_state), "gauss": gauss},
        "numpy": {
            "kind": kind,
            "keys": _b64(np.asarray(keys, dtype="<u4").tobytes()),
            "position": int(position),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": _b64(torch.get_rng_state().numpy().tobytes()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = [_b64(device_state.numpy().tobytes()) for device_state in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(state: Any) -> None:
    """Restore the state `capture_rng_state` returned (after a JSON round trip).

    Raises:
        RngStateError: `state` is not such a mapping (names the part that is wrong).
    """
    try:
        if not isinstance(state, dict) or state.get("format") != RNG_FORMAT:
            raise RngStateError(f"expected a mapping with format={RNG_FORMAT}")
        python = state["python"]
        python_state = (int(python["version"]), tuple(int(value) for value in python["state"]), python["gauss"])
        numpy_state = state["numpy"]
        keys = np.frombuffer(_unb64(numpy_state["keys"]), dtype="<u4").astype(np.uint32)
        numpy_tuple = (
            str(numpy_state["kind"]),
            keys,
            int(numpy_state["position"]),
            int(numpy_state["has_gauss"]),
            float(numpy_state["cached_gaussian"]),
        )
        torch_state = _byte_tensor(state["torch"])
        cuda_states = [_byte_tensor(item) for item in state.get("cuda", [])]
        random.setstate(python_state)
        np.random.set_state(numpy_tuple)
        torch.set_rng_state(torch_state)
    except RngStateError:
        raise
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        raise RngStateError(f"malformed RNG state: {error!r}") from error
    if cuda_states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda_states)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: Any) -> bytes:
    if not isinstance(text, str):
        raise RngStateError(f"expected a base64 string, got {type(text).__name__}")
    return base64.b64decode(text, validate=True)


def _byte_tensor(text: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(_unb64(text)), dtype=torch.uint8)
