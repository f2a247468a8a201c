"""Optional MoE auxiliary losses and the way they reach backward without changing the layer's outputs."""

from __future__ import annotations

from typing import Any

import torch


def load_balancing_loss(scores: torch.Tensor, group_sizes: torch.Tensor, top_k: int) -> torch.Tensor:
    """Switch-Transformer balance loss `E * sum_e f_e * P_e`, 1 at perfect balance.

    `f_e` is the fraction of the `T * k` routed slots that went to expert `e` (no gradient), `P_e` the mean
    router probability of `e` over the `T` tokens (softmax scores; normalised per token for sigmoid scores).
    """
    num_tokens, num_experts = scores.shape
    probs = scores / scores.sum(dim=-1, keepdim=True)
    fraction = group_sizes.float() / max(num_tokens * top_k, 1)
    return num_experts * (fraction * probs.mean(dim=0)).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE z-loss: mean squared log-sum-exp of the router logits (keeps them small)."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on `hidden` whose backward also sends a gradient of one into `aux_loss`."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
        ctx.aux_shape = aux_loss.shape
        ctx.aux_dtype = aux_loss.dtype
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, torch.ones(ctx.aux_shape, dtype=ctx.aux_dtype, device=grad.device)


def attach_aux_loss(hidden: torch.Tensor, aux_loss: torch.Tensor) -> torch.Tensor:
    """`hidden`, unchanged, such that backward through it also backpropagates `aux_loss` (a scalar).

    The auxiliary loss thus trains the router without being threaded through the model's outputs, pipeline
    stages included. Its gradient is not divided by anything: scale it with the loss coefficient.
    """
    out = _AttachAuxLoss.apply(hidden, aux_loss)  # type: ignore[no-untyped-call]
    assert isinstance(out, torch.Tensor)
    return out
