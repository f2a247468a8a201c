"""Initialisation shared by the LoRA modules: A uniform (as `peft`'s default), B zero, so a fresh adapter adds 0."""

from __future__ import annotations

import math

import torch
from torch import nn

from d9d.core.determinism import init_parameter_


def init_lora_a_(tensor: torch.Tensor, in_features: int) -> None:
    # kaiming_uniform_(a=sqrt(5)) on (r, in), peft's default, is U(-1/sqrt(in), 1/sqrt(in)); written out so the
    # stacked (E, r, in) expert adapters get the same per-expert distribution.
    bound = 1.0 / math.sqrt(in_features)
    init_parameter_(tensor, lambda full: nn.init.uniform_(full, -bound, bound))


def init_lora_b_(tensor: torch.Tensor) -> None:
    init_parameter_(tensor, nn.init.zeros_)


def adapter_parameter(*shape: int, like: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device=like.device, dtype=like.dtype))
