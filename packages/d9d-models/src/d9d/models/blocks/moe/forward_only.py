"""Bookkeeping that counts real forwards only: the expert load and the sum of the weighted auxiliary losses.

An activation-checkpoint recomputation runs a layer's forward again inside backward, and must not count its routing
a second time. The test (`torch._C._current_graph_task_id() != -1`: autograd is running a backward) returns a Python
bool, which Dynamo cannot trace: inline in a compiled decoder layer it cost a graph break per MoE layer (seen in
docs/benchmarks.md, "Session 10", where the compiled 1-GPU MoE anchor ran at 0.87x eager with it and the Triton
kernels). Under compilation the test therefore runs inside two custom ops, which Dynamo keeps opaque and which
decide when the graph runs: `expert_load_increment` (the loads to add to the count, zeros in a recomputation) and
`forward_pass_weight` (1 in a real forward, 0 in a recomputation, only called from compiled code). Eager calls of the
first run its body directly, without the dispatcher (`kernel_op`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from d9d.kernels.triton_support import kernel_op

# A custom op takes no process group, only a name: the groups handed to `record_expert_load`, by name (filled when
# the Python code runs, eagerly or while Dynamo traces; read when the op runs). Groups live as long as the job.
_groups_by_name: dict[str, dist.ProcessGroup] = {}


def in_backward() -> bool:
    """True while autograd runs a backward pass: an activation-checkpoint recomputation, not a real forward."""
    return bool(torch._C._current_graph_task_id() != -1)


# Functional (no `mutates_args`): the addition to the count is traced as an ordinary in-place add on the buffer. A
# mutating custom op becomes an `auto_functionalized` higher-order op in the graph, which selective checkpointing's
# dispatch mode cannot run (aot_eager) and so failed every compiled MoE layer under the `selective` policy. A
# `kernel_op`: eager calls (gradient recording off) run the body without the dispatcher.
@kernel_op("d9d_models::expert_load_increment")
def _expert_load_increment(routed: torch.Tensor, group_name: str | None) -> torch.Tensor:
    """`routed` as a new float32 tensor summed over the named group; zeros in a recomputation."""
    if in_backward():
        return torch.zeros(routed.shape, dtype=torch.float32, device=routed.device)
    loads = routed.to(torch.float32, copy=True)  # a copy: the all-reduce is in place, and an op's output is no alias
    if group_name is not None:
        dist.all_reduce(loads, group=_groups_by_name[group_name])
    return loads


@_expert_load_increment.register_fake
def _(routed: torch.Tensor, group_name: str | None) -> torch.Tensor:
    return torch.empty(routed.shape, dtype=torch.float32, device=routed.device)


def record_expert_load(
    tokens_per_expert: torch.Tensor, routed: torch.Tensor, group: dist.ProcessGroup | None = None
) -> None:
    """`tokens_per_expert += routed` (summed over `group` first, if given), unless this is a recomputation."""
    group_name = None
    if group is not None:
        group_name = group.group_name
        _groups_by_name[group_name] = group
    with torch.no_grad():
        tokens_per_expert.add_(_expert_load_increment(routed, group_name))


@torch.library.custom_op("d9d_models::forward_pass_weight", mutates_args=())
def _forward_pass_weight_op(like: torch.Tensor) -> torch.Tensor:
    return torch.full((), 0.0 if in_backward() else 1.0, dtype=like.dtype, device=like.device)


@_forward_pass_weight_op.register_fake
def _(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(())


def forward_pass_weight(like: torch.Tensor) -> torch.Tensor:
    """1 in a real forward, 0 in a recomputation, as a 0-dim tensor of `like`'s dtype and device: for compiled code,
    where the test must run when the graph does (eager code calls `in_backward()`)."""
    weight: torch.Tensor = _forward_pass_weight_op(like)
    return weight
