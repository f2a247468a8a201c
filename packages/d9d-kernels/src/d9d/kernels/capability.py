"""What the machine can run: device type, CUDA compute capability, and which optional kernel packages exist.

Capability detection is the last step of backend selection (after an explicit config and the environment). It only
looks: it never imports an optional package, so detecting costs nothing and cannot fail on a broken install.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class Capabilities:
    """The facts backend auto-selection decides on."""

    device_type: str
    cuda_capability: tuple[int, int] | None = None
    installed: frozenset[str] = frozenset()

    def has_package(self, name: str) -> bool:
        return name in self.installed

    def cuda_at_least(self, major: int, minor: int = 0) -> bool:
        return self.cuda_capability is not None and self.cuda_capability >= (major, minor)


OPTIONAL_PACKAGES = ("deep_ep", "flash_attn", "grouped_gemm", "triton")


def detect_capabilities(device: torch.device | str | None = None) -> Capabilities:
    """Capabilities of `device` (default: the current CUDA device when CUDA is available, else the CPU)."""
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    capability = None
    if device.type == "cuda" and torch.cuda.is_available():
        capability = torch.cuda.get_device_capability(device)
    installed = frozenset(name for name in OPTIONAL_PACKAGES if importlib.util.find_spec(name) is not None)
    return Capabilities(device_type=device.type, cuda_capability=capability, installed=installed)
