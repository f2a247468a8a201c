"""The MoE layer: route, permute (or dispatch), grouped experts, un-permute (or combine), plus shared experts."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from d9d.kernels.eager_only import eager_only
from d9d.kernels.expert_dispatch import AnyExpertDispatchConfig, TokenDispatcher, count_per_expert
from d9d.kernels.grouped_mm import GroupedMm
from d9d.models.blocks.ffn import SwiGLU
from d9d.models.blocks.moe.capacity import drop_over_capacity
from d9d.models.blocks.moe.experts import GroupedSwiGLU
from d9d.models.blocks.moe.forward_only import forward_pass_weight, in_backward, record_expert_load
from d9d.models.blocks.moe.losses import attach_aux_loss, load_balancing_loss, router_z_loss
from d9d.models.blocks.moe.permute import permute_tokens, unpermute_tokens
from d9d.models.blocks.moe.router import RouterScoring, TopKRouter


class MoELayer(nn.Module):
    """`x -> sum_k w_k * expert_k(x) (+ shared(x))` over `(batch, seq, hidden)`.

    `tokens_per_expert` (a buffer, not saved) accumulates the routed load of every forward pass until
    `reset_load()`: log it, or all-reduce it and feed `router.update_expert_bias_`. With `load_balancing_coef` or
    `z_loss_coef` above zero the auxiliary losses are added to backward (see `attach_aux_loss`); their last values
    are in `aux_losses` for logging. `aux_loss_weight` scales what reaches backward: a training loop that runs a
    step as several micro-batches (and data-parallel ranks) sets it to one over their number, so the step's
    auxiliary loss is their mean (see `AuxLossWeights`).

    Expert parallelism (`parallelize_experts`) sets `dispatcher`: token copies then travel to the ranks owning their
    experts and back instead of being permuted locally; `dispatch_config` names the backend it builds (`None`:
    environment, then detection); in a compiled layer the exchange, the local experts and the load count stay eager
    (`_exchange_through_experts`, one graph break). `capacity_factor` (default off) drops the copies beyond
    `ceil(factor * T * k / E)` per expert on each rank; the load counts what the router chose, before dropping.
    """

    tokens_per_expert: torch.Tensor
    # d9d-pipeline's CUDA graphs (design note 0028) keep a pipeline with MoE layers eager: the load count, the
    # auxiliary losses' bookkeeping and the dispatch's group sizes are host-side per forward.
    pipeline_cuda_graphs_unsupported = "MoE layers route on the host (group sizes, load and auxiliary-loss bookkeeping)"

    def __init__(
        self,
        *,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        expert_intermediate_size: int,
        grouped_mm: GroupedMm,
        scoring: RouterScoring = RouterScoring.SOFTMAX,
        normalize_top_k: bool = True,
        expert_bias: bool = False,
        shared_intermediate_size: int = 0,
        load_balancing_coef: float = 0.0,
        z_loss_coef: float = 0.0,
        init_std: float = 0.02,
        capacity_factor: float | None = None,
        dispatch_config: AnyExpertDispatchConfig | None = None,
    ) -> None:
        super().__init__()
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be positive (or None for no limit), got {capacity_factor}")
        self.num_experts = num_experts
        self.capacity_factor = capacity_factor
        self.dispatch_config = dispatch_config
        self.dispatcher: TokenDispatcher | None = None
        self.load_balancing_coef, self.z_loss_coef = load_balancing_coef, z_loss_coef
        self.router = TopKRouter(
            hidden_size,
            num_experts,
            top_k,
            scoring=scoring,
            normalize_top_k=normalize_top_k,
            expert_bias=expert_bias,
            init_std=init_std,
        )
        self.experts = GroupedSwiGLU(
            num_experts, hidden_size, expert_intermediate_size, backend=grouped_mm, init_std=init_std
        )
        self.shared_experts = (
            SwiGLU(hidden_size, shared_intermediate_size, init_std=init_std) if shared_intermediate_size > 0 else None
        )
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts, dtype=torch.float32), persistent=False)
        self.aux_losses: dict[str, torch.Tensor] = {}
        self.aux_loss_weight = 1.0
        # Set by a parallel plan when this block routes a shard of tokens whose other shards the ranks of this group
        # route (tensor parallelism without expert parallelism): loads are summed over the group, so every rank sees
        # the same counts, and each rank's auxiliary loss counts for 1/size of the group.
        self.token_shard_group: dist.ProcessGroup | None = None
        # The weighted auxiliary losses of the training forwards since the last `take_weighted_aux_loss()`.
        self._weighted_aux_sum: torch.Tensor | None = None

    def reset_parameters(self) -> None:
        self.router.reset_parameters()
        self.experts.reset_parameters()
        if self.shared_experts is not None:
            self.shared_experts.reset_parameters()
        self.reset_load()

    @property
    def exchange_dropped_copies(self) -> torch.Tensor | None:
        """Routed copies the expert-parallel exchange dropped over its capacity, summed since its dispatcher was built
        (`all_to_all_capacity`; a device tensor, so log it when metrics are read: reading it synchronises), or None
        where the exchange has no capacity of its own."""
        dropped = getattr(self.dispatcher, "dropped_copies", None)
        return dropped if isinstance(dropped, torch.Tensor) else None

    def reset_load(self) -> None:
        with torch.no_grad():
            self.tokens_per_expert.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        routing = self.router(flat)
        routed = count_per_expert(routing.expert_indices.reshape(-1), self.num_experts)
        indices = routing.expert_indices
        if self.capacity_factor is not None:
            indices = drop_over_capacity(indices, self.num_experts, self.capacity_factor)
        if self.dispatcher is None:
            permuted = permute_tokens(flat, indices, self.num_experts, may_drop=self.capacity_factor is not None)
            expert_rows = self.experts(permuted.rows, permuted.group_sizes)
            out = unpermute_tokens(expert_rows, permuted, routing.expert_weights)
            self._record_load(routed)
        elif self.dispatcher.traceable:  # static shapes, no host copy: compiled layers include the exchange
            out = self._exchange(flat, indices, routing.expert_weights, routed)
        else:
            out = self._exchange_through_experts(flat, indices, routing.expert_weights, routed)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        out = self._add_aux_losses(out, routing.scores, routing.logits, routed)
        return out.view(shape)

    @eager_only
    def _exchange_through_experts(
        self, flat: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, routed: torch.Tensor
    ) -> torch.Tensor:
        """Dispatch, the local experts, combine (and the load count): always eager, one graph break when the layer
        is compiled (`compile_layers`, `compile_model`; design 0025, third round). The exchange copies its split
        sizes to the host and sends them as Python lists, which Dynamo would bake into guards (a recompilation per
        new routing); the experts' row count depends on the routing too, their parameters are swapped for
        compute-dtype copies by a hook (efsdp = 1) or all-gathered by their own FSDP unit (efsdp > 1), and they
        launch only three grouped GEMMs and a SwiGLU. Everything before (norms, attention, router) and after
        (shared experts, residual) stays in the compiled graphs. A `traceable` dispatcher (`all_to_all_capacity`)
        skips this wrapper: `forward` calls `_exchange` directly (design 0029)."""
        return self._exchange(flat, indices, weights, routed)

    def _exchange(
        self, flat: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, routed: torch.Tensor
    ) -> torch.Tensor:
        assert self.dispatcher is not None
        # Named ranges, so a profile shows the share of a step spent moving tokens (bench/expert_parallel.py).
        with record_function("moe.dispatch"):
            dispatched = self.dispatcher.dispatch(flat, indices, weights)
        expert_rows = self.experts(dispatched.rows, dispatched.group_sizes)
        with record_function("moe.combine"):
            out = self.dispatcher.combine(expert_rows, dispatched)
        self._record_load(routed)
        return out

    def _record_load(self, routed: torch.Tensor) -> None:
        """Add the routed copies per expert to `tokens_per_expert`, unless this is an activation-checkpoint
        recomputation (not another forward); traceable (`forward_only`)."""
        record_expert_load(self.tokens_per_expert, routed, self.token_shard_group)

    def _add_aux_losses(
        self, out: torch.Tensor, scores: torch.Tensor, logits: torch.Tensor, group_sizes: torch.Tensor
    ) -> torch.Tensor:
        terms: dict[str, torch.Tensor] = {}
        if self.load_balancing_coef > 0:
            terms["load_balancing"] = load_balancing_loss(scores, group_sizes, self.router.top_k)
        if self.z_loss_coef > 0:
            terms["z_loss"] = router_z_loss(logits)
        if not terms:
            return out
        self.aux_losses = {name: value.detach() for name, value in terms.items()}
        shards = 1 if self.token_shard_group is None else dist.get_world_size(self.token_shard_group)
        total = (self.aux_loss_weight / shards) * (
            self.load_balancing_coef * terms.get("load_balancing", 0.0) + self.z_loss_coef * terms.get("z_loss", 0.0)
        )
        assert isinstance(total, torch.Tensor)
        if not torch.is_grad_enabled():
            return out
        # A recomputation (activation checkpointing) is not another forward; compiled code decides when it runs.
        done = total.detach()
        if torch.compiler.is_compiling():
            done = done * forward_pass_weight(done)
        elif in_backward():
            return attach_aux_loss(out, total)
        self._weighted_aux_sum = done if self._weighted_aux_sum is None else self._weighted_aux_sum + done
        return attach_aux_loss(out, total)

    def take_weighted_aux_loss(self) -> torch.Tensor | None:
        """The weighted auxiliary losses that went into backward since the last call (None: none did); resets."""
        taken, self._weighted_aux_sum = self._weighted_aux_sum, None
        if taken is not None and self.token_shard_group is not None:
            dist.all_reduce(taken, group=self.token_shard_group)  # the shards' parts of the step's auxiliary loss
        return taken
