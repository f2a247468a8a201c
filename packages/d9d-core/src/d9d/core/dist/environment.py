"""Reading the launcher's environment (torchrun sets it) and choosing the device and backend."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

DeviceChoice = Literal["auto", "cpu", "cuda"]
DEVICE_ENV = "D9D_DEVICE"
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@dataclass(frozen=True, kw_only=True)
class LaunchEnvironment:
    """Where this process sits in the launch: global and node-local rank and size."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @property
    def is_single_process(self) -> bool:
        return self.world_size == 1

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None) -> LaunchEnvironment:
        """Read RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE; none of them set means one process."""
        env = dict(os.environ) if environ is None else environ
        present = [name for name in _LAUNCH_VARS if name in env]
        if not present:
            return cls(rank=0, world_size=1, local_rank=0, local_world_size=1)
        if "RANK" not in env or "WORLD_SIZE" not in env:
            raise ValueError(
                f"launcher environment is incomplete: {', '.join(present)} set but RANK and WORLD_SIZE are both "
                "needed; launch with torchrun, or unset all of RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE."
            )
        values: dict[str, int] = {}
        for name in _LAUNCH_VARS:
            raw = env.get(name)
            if raw is None:
                continue
            try:
                values[name] = int(raw)
            except ValueError:
                raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None
        world_size = values["WORLD_SIZE"]
        rank = values["RANK"]
        local_world_size = values.get("LOCAL_WORLD_SIZE", world_size)
        local_rank = values.get("LOCAL_RANK", rank % local_world_size)
        if not 0 <= rank < world_size:
            raise ValueError(f"RANK={rank} is outside [0, WORLD_SIZE={world_size})")
        if not 0 <= local_rank < local_world_size or world_size % local_world_size != 0:
            raise ValueError(
                f"LOCAL_RANK={local_rank}, LOCAL_WORLD_SIZE={local_world_size} do not fit WORLD_SIZE={world_size}; "
                "LOCAL_RANK must lie in [0, LOCAL_WORLD_SIZE) and LOCAL_WORLD_SIZE must divide WORLD_SIZE."
            )
        return cls(rank=rank, world_size=world_size, local_rank=local_rank, local_world_size=local_world_size)


def resolve_device_type(requested: DeviceChoice | None = None) -> Literal["cpu", "cuda"]:
    """Pick the device type: an explicit choice, then `D9D_DEVICE`, then CUDA when a GPU is visible."""
    choice = requested if requested not in (None, "auto") else os.environ.get(DEVICE_ENV, "auto")
    match choice:
        case "cpu":
            return "cpu"
        case "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError(
                    f"device 'cuda' was requested (argument or {DEVICE_ENV}) but no CUDA device is visible; "
                    "use 'cpu' or 'auto'."
                )
            return "cuda"
        case "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        case _:
            raise ValueError(f"{DEVICE_ENV}={choice!r} is not a device choice; valid: 'auto', 'cpu', 'cuda'.")


def backend_for(device_type: Literal["cpu", "cuda"]) -> str:
    """NCCL for CUDA tensors (with gloo beside it for CPU-side objects), gloo on CPU."""
    return "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"


def moves_cpu_tensors(group: dist.ProcessGroup | None = None) -> bool:
    """Whether collectives over `group` (default: the default group) take CPU tensors: it has a gloo backend, alone
    or beside NCCL (`backend_for('cuda')`; subgroups made without a backend inherit the default group's)."""
    return "gloo" in str(dist.get_backend(group))
