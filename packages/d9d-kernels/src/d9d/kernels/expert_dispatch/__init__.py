"""Expert dispatch behind one interface: all-to-all (reference, gloo and NCCL), all-to-all with a static capacity
(no host sync), the same sending each token once per destination rank, and DeepEP (optional)."""

from d9d.kernels.expert_dispatch.all_to_all import AllToAllDispatcher, all_to_all
from d9d.kernels.expert_dispatch.api import DispatchedTokens, TokenDispatcher, mark_row_count_dynamic, split_experts
from d9d.kernels.expert_dispatch.capacity import AllToAllCapacityDispatcher, pair_capacity
from d9d.kernels.expert_dispatch.capacity_tokens import (
    AllToAllTokenCapacityDispatcher,
    expert_row_capacity,
    token_pair_capacity,
)
from d9d.kernels.expert_dispatch.config import (
    EXPERT_DISPATCH_CONFIG_ADAPTER,
    AllToAllCapacityDispatchConfig,
    AllToAllDispatchConfig,
    AllToAllTokensDispatchConfig,
    AnyExpertDispatchConfig,
    DeepEpDispatchConfig,
    build_token_dispatcher,
    capabilities_of_group,
    detect_expert_dispatch_config,
    resolve_expert_dispatch_config,
)
from d9d.kernels.expert_dispatch.deep_ep import DeepEpDispatcher, import_deep_ep
from d9d.kernels.expert_dispatch.sorting import (
    ExpertOrder,
    count_per_expert,
    gather_sorted_rows,
    permute_rows,
    sort_by_expert,
    weighted_unsort,
)

__all__ = [
    "EXPERT_DISPATCH_CONFIG_ADAPTER",
    "AllToAllCapacityDispatchConfig",
    "AllToAllCapacityDispatcher",
    "AllToAllDispatchConfig",
    "AllToAllDispatcher",
    "AllToAllTokenCapacityDispatcher",
    "AllToAllTokensDispatchConfig",
    "AnyExpertDispatchConfig",
    "DeepEpDispatchConfig",
    "DeepEpDispatcher",
    "DispatchedTokens",
    "ExpertOrder",
    "TokenDispatcher",
    "all_to_all",
    "build_token_dispatcher",
    "capabilities_of_group",
    "count_per_expert",
    "detect_expert_dispatch_config",
    "expert_row_capacity",
    "gather_sorted_rows",
    "import_deep_ep",
    "mark_row_count_dynamic",
    "pair_capacity",
    "permute_rows",
    "resolve_expert_dispatch_config",
    "sort_by_expert",
    "split_experts",
    "token_pair_capacity",
    "weighted_unsort",
]
