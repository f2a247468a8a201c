"""Top-k expert routing: softmax, or sigmoid with a selection bias for auxiliary-loss-free balancing."""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional

from d9d.models.blocks.late_init import init_normal_, init_zeros_


class RouterScoring(enum.StrEnum):
    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"


@dataclass(frozen=True)
class RoutingResult:
    """Per token `(T, ...)`: chosen experts, their combine weights (activation dtype), raw logits, float32 scores."""

    expert_indices: torch.Tensor
    expert_weights: torch.Tensor
    logits: torch.Tensor
    scores: torch.Tensor


class TopKRouter(nn.Module):
    """Scores every expert per token and keeps the `top_k` best.

    Softmax scoring (Qwen3-MoE) takes probabilities over all experts. Sigmoid scoring scores each expert on its own;
    with `expert_bias`, a per-expert bias (a buffer, not a parameter) is added for *selection only*, and an
    outer loop nudges it towards balanced load (`update_expert_bias_`) instead of an auxiliary loss
    (DeepSeek-V3). Combine weights are the unbiased scores of the chosen experts, renormalised to sum to one when
    `normalize_top_k`.
    """

    expert_bias: torch.Tensor | None

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        scoring: RouterScoring = RouterScoring.SOFTMAX,
        normalize_top_k: bool = True,
        expert_bias: bool = False,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        if expert_bias and scoring != RouterScoring.SIGMOID:
            raise ValueError("expert_bias (auxiliary-loss-free balancing) needs sigmoid scoring")
        self.num_experts, self.top_k = num_experts, top_k
        self.scoring, self.normalize_top_k = scoring, normalize_top_k
        self.init_std = init_std
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        if expert_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))
        else:
            self.expert_bias = None
        self.forced_indices: torch.Tensor | None = None

    def reset_parameters(self) -> None:
        init_normal_(self.weight, self.init_std)
        if self.expert_bias is not None:
            init_zeros_(self.expert_bias)

    def forward(self, x: torch.Tensor) -> RoutingResult:
        """Route tokens `x` `(T, hidden)`."""
        logits = functional.linear(x, self.weight)
        scores = (
            torch.softmax(logits.float(), dim=-1) if self.scoring == RouterScoring.SOFTMAX else logits.float().sigmoid()
        )
        if self.forced_indices is not None:
            indices = self.forced_indices.to(device=x.device, dtype=torch.int64)
        else:
            selection = scores if self.expert_bias is None else scores + self.expert_bias
            indices = torch.topk(selection, self.top_k, dim=-1).indices
        weights = scores.gather(1, indices)
        if self.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return RoutingResult(expert_indices=indices, expert_weights=weights.to(x.dtype), logits=logits, scores=scores)

    @torch.no_grad()
    def update_expert_bias_(self, tokens_per_expert: torch.Tensor, rate: float) -> None:
        """Raise the bias of under-loaded experts and lower it for over-loaded ones by `rate` (sign update).

        `tokens_per_expert` should be the load summed over every data-parallel rank (all-reduce it first).
        """
        if self.expert_bias is None:
            raise ValueError("this router has no expert bias (build it with scoring='sigmoid', expert_bias=True)")
        load = tokens_per_expert.float().to(self.expert_bias.device)
        self.expert_bias.add_(rate * torch.sign(load.mean() - load))

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, top_k={self.top_k}, scoring={self.scoring.value}"


@contextlib.contextmanager
def force_routing(choices: Mapping[TopKRouter, torch.Tensor]) -> Iterator[None]:
    """Make each router choose the given experts `(T, top_k)` instead of its top-k (routing replay).

    Scores, combine weights and gradients still come from the router's own weights. Used to compare against
    another implementation whose near-tied scores could otherwise flip a choice in low precision.
    """
    try:
        for router, indices in choices.items():
            router.forced_indices = indices
        yield
    finally:
        for router in choices:
            router.forced_indices = None
