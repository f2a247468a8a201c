"""Which kernel each block runs: built once per model from `DecoderConfig`, then set on the blocks that declare them.

Every block computes with an eager PyTorch backend by default; `apply_block_kernels` replaces it with the backend
`build_block_kernels` resolved (explicit config > `D9D_BACKEND_AUTO_<FAMILY>` > detection: Triton on a CUDA GPU with
Triton installed, eager on CPU). Blocks are found by the attribute they declare, not by class, so wrapped or adapted
blocks get their kernels too.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

import d9d.models.blocks.pipeline_split  # noqa: F401 - wires the pipeline's split backward into the kernels
from d9d.kernels.linear_cross_entropy import (
    EagerLinearCrossEntropyConfig,
    LinearCrossEntropyKernel,
    build_linear_cross_entropy,
    resolve_linear_cross_entropy_config,
)
from d9d.kernels.moe_permute import MoePermuteKernel, build_moe_permute
from d9d.kernels.rms_norm import RmsNormKernel, build_rms_norm
from d9d.kernels.rope import RopeKernel, build_rope
from d9d.kernels.swiglu import SwiGluKernel, build_swiglu
from d9d.models.config import DecoderConfig


@dataclass(frozen=True)
class BlockKernels:
    """One backend per kernel family; `linear_cross_entropy=None` keeps the head's own chunked PyTorch loss."""

    rms_norm: RmsNormKernel
    swiglu: SwiGluKernel
    rope: RopeKernel
    moe_permute: MoePermuteKernel
    linear_cross_entropy: LinearCrossEntropyKernel | None


def build_block_kernels(config: DecoderConfig) -> BlockKernels:
    """The backends `config` asks for (its `None` fields resolved from the environment, then the machine)."""
    loss_config = resolve_linear_cross_entropy_config(config.linear_cross_entropy)
    return BlockKernels(
        rms_norm=build_rms_norm(config.rms_norm),
        swiglu=build_swiglu(config.swiglu),
        rope=build_rope(config.rope),
        moe_permute=build_moe_permute(config.moe_permute),
        linear_cross_entropy=None
        if isinstance(loss_config, EagerLinearCrossEntropyConfig)
        else build_linear_cross_entropy(loss_config),
    )


_SLOTS = {
    "rms_norm_kernel": "rms_norm",  # RMSNorm
    "swiglu_kernel": "swiglu",  # SwiGLU, GroupedSwiGLU
    "rope_kernel": "rope",  # GroupedQueryAttention
    "permute_kernel": "moe_permute",  # MoELayer
    "loss_kernel": "linear_cross_entropy",  # SplitLanguageModellingHead
}


def apply_block_kernels(model: nn.Module, kernels: BlockKernels) -> None:
    """Set each block's kernel attribute (`rms_norm_kernel`, `swiglu_kernel`, `rope_kernel`, `permute_kernel`,
    `loss_kernel`)."""
    for module in model.modules():
        for attribute, family in _SLOTS.items():
            if attribute in vars(module):
                setattr(module, attribute, getattr(kernels, family))
