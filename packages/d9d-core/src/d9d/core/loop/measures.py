"""Throughput, MFU and memory figures of a step."""

from __future__ import annotations

import resource
import sys

import torch


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated accelerator memory on CUDA; peak resident set size of the process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**30 if sys.platform == "darwin" else rss / 2**20  # bytes on macOS, KiB on Linux


def mfu(
    tokens_per_second: float, flops_per_token: float | None, peak_flops: float | None, devices: int
) -> float | None:
    """Model FLOPs utilisation: achieved model FLOPs over the devices' peak, or None if either is unknown."""
    if flops_per_token is None or peak_flops is None:
        return None
    return tokens_per_second * flops_per_token / (peak_flops * devices)
