"""Tensor + sequence-parallel plans of the Qwen3 families (docs/design/0005), and the check of the `tp` degree.

The same plan runs in two layouts (`TensorParallelConfig.sequence_parallel`): with sequence parallelism (training)
the activations between regions are split along the sequence; without it (inference, docs/design/0019) they are
whole on every rank, each region ending in an all-reduce. Parameters are placed identically in both.

A plan is a list of (selector, style) entries applied in order; a module takes the style of the first entry that
selects it. Selectors are names (segment patterns, see `d9d.parallel.plan`) or roles, never classes, so a LoRA
wrapper at `self_attn.q_proj` is split like the linear it replaced.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from d9d.models.blocks.decoder import DecoderBackbone
from d9d.models.qwen3.params import Qwen3DenseParameters, Qwen3MoeParameters
from d9d.models.roles import Role
from d9d.parallel import ByName, ByRole, ModuleSelector, select_modules
from d9d.parallel.tensor import (
    REPLICATED,
    TensorParallelConfig,
    enable_async_tp,
    fold_tp_into_shard,
    parallelize_column,
    parallelize_local_region,
    parallelize_replicated,
    parallelize_row,
    parallelize_sequence,
    parallelize_vocab_embedding,
    parallelize_vocab_head,
    prepare_region_input,
)

__all__ = [
    "TensorParallelConfig",
    "TensorParallelPlan",
    "TpStyle",
    "apply_qwen3_tensor_parallel",
    "check_qwen3_tp_degrees",
    "expert_units_mesh",
    "qwen3_dense_tp_plan",
    "qwen3_moe_tp_plan",
]


class TpStyle(enum.StrEnum):
    COLUMN = "column"  # split output features (q/k/v, gate/up)
    ROW = "row"  # split input features, reduce-scatter to the sequence shard (o, down)
    SEQUENCE = "sequence"  # replicated parameters on the activations between blocks (norms): sequence shard or whole
    PER_HEAD = "per_head"  # replicated parameters on this rank's heads (q/k RMSNorm)
    REGION_INPUT = "region_input"  # gather the sequence at the entry of attention / FFN
    LOCAL_REGION = "local_region"  # run on the sequence shard with data-parallel parameters (MoE block)
    VOCAB_EMBEDDING = "vocab_embedding"
    VOCAB_HEAD = "vocab_head"


_SEQUENCE_PARALLEL_STYLES: dict[TpStyle, Callable[[nn.Module, DeviceMesh], None]] = {
    TpStyle.COLUMN: parallelize_column,
    TpStyle.ROW: parallelize_row,
    TpStyle.SEQUENCE: parallelize_sequence,
    TpStyle.PER_HEAD: lambda module, mesh: parallelize_sequence(module, mesh, dim=2, use_local_output=True),
    TpStyle.REGION_INPUT: prepare_region_input,
    TpStyle.LOCAL_REGION: parallelize_local_region,
    TpStyle.VOCAB_EMBEDDING: parallelize_vocab_embedding,
    TpStyle.VOCAB_HEAD: parallelize_vocab_head,
}
# Without sequence parallelism: the same parameter placements, activations `Replicate` between regions.
_REPLICATED_STYLES: dict[TpStyle, Callable[[nn.Module, DeviceMesh], None]] = {
    **_SEQUENCE_PARALLEL_STYLES,
    TpStyle.ROW: lambda module, mesh: parallelize_row(module, mesh, output=REPLICATED),
    TpStyle.SEQUENCE: parallelize_replicated,
    TpStyle.LOCAL_REGION: lambda module, mesh: parallelize_local_region(module, mesh, placement=REPLICATED),
    TpStyle.VOCAB_EMBEDDING: lambda module, mesh: parallelize_vocab_embedding(module, mesh, output=REPLICATED),
}


@runtime_checkable
class TokenSharded(Protocol):
    """A block that sums statistics over the ranks holding the other shards of its tokens (`MoELayer`)."""

    token_shard_group: dist.ProcessGroup | None


@dataclass(frozen=True)
class TensorParallelPlan:
    """Entries applied in order (first match wins), and the model's hyperparameters the degree is checked against."""

    entries: list[tuple[ModuleSelector, TpStyle]]
    params: Qwen3DenseParameters


_ATTENTION: list[tuple[ModuleSelector, TpStyle]] = [
    (ByName("**.self_attn"), TpStyle.REGION_INPUT),
    (ByName("**.self_attn.q_proj"), TpStyle.COLUMN),
    (ByName("**.self_attn.k_proj"), TpStyle.COLUMN),
    (ByName("**.self_attn.v_proj"), TpStyle.COLUMN),
    (ByName("**.self_attn.o_proj"), TpStyle.ROW),
    (ByName("**.self_attn.q_norm"), TpStyle.PER_HEAD),
    (ByName("**.self_attn.k_norm"), TpStyle.PER_HEAD),
]
_FFN: list[tuple[ModuleSelector, TpStyle]] = [
    (ByName("**.mlp"), TpStyle.REGION_INPUT),
    (ByName("**.mlp.gate_proj"), TpStyle.COLUMN),
    (ByName("**.mlp.up_proj"), TpStyle.COLUMN),
    (ByName("**.mlp.down_proj"), TpStyle.ROW),
]
_EDGES: list[tuple[ModuleSelector, TpStyle]] = [
    (ByRole(str(Role.EMBEDDING)), TpStyle.VOCAB_EMBEDDING),
    (ByRole(str(Role.LM_HEAD)), TpStyle.VOCAB_HEAD),
    (ByName("**.input_layernorm"), TpStyle.SEQUENCE),
    (ByName("**.post_attention_layernorm"), TpStyle.SEQUENCE),
    (ByName("model.norm"), TpStyle.SEQUENCE),
]


def qwen3_dense_tp_plan(model: nn.Module) -> TensorParallelPlan:
    return TensorParallelPlan(entries=[*_EDGES, *_ATTENTION, *_FFN], params=_params_of(model))


def qwen3_moe_tp_plan(model: nn.Module) -> TensorParallelPlan:
    """The dense plan, with each MoE block (found by role, before the `mlp` entries) on the sequence shard."""
    moe = [(ByRole(str(Role.MOE)), TpStyle.LOCAL_REGION)]
    return TensorParallelPlan(entries=[*_EDGES, *_ATTENTION, *moe, *_FFN], params=_params_of(model))


def apply_qwen3_tensor_parallel(
    model: nn.Module, mesh: DeviceMesh, plan: TensorParallelPlan, config: TensorParallelConfig
) -> None:
    """Apply `plan` on the 1-D `tp` mesh, in place, on a model built on the meta device, with or without sequence
    parallelism (`config.sequence_parallel`; without it an MoE block routes every token on every tp rank).

    Raises:
        ValueError: the shapes do not divide by the mesh size (see `check_qwen3_tp_degrees`), or a parameter outside
            the MoE blocks was left out of the plan (it would silently train differently on each tp rank).
    """
    check_qwen3_tp_degrees(plan.params, mesh.size())
    styles = _SEQUENCE_PARALLEL_STYLES if config.sequence_parallel else _REPLICATED_STYLES
    claimed: set[int] = set()
    local_regions: list[nn.Module] = []
    for selector, style in plan.entries:
        for _, module in select_modules(model, [selector]):
            if id(module) in claimed:
                continue
            claimed.add(id(module))
            styles[style](module, mesh)
            if style is TpStyle.LOCAL_REGION:
                local_regions.append(module)
                # An MoE block on a sequence shard: loads and aux losses span the tp shards. Replicated, every rank
                # routes all the tokens and its own counts are the whole batch's.
                if isinstance(module, TokenSharded) and config.sequence_parallel:
                    module.token_shard_group = mesh.get_group()
    _check_covered(model, local_regions)
    for module in model.modules():
        if isinstance(module, DecoderBackbone) and config.sequence_parallel:
            module.sequence_parallel_mesh = mesh  # pipeline stages hand over their sequence shard (see there)
    if config.async_tp:
        enable_async_tp(mesh)


def expert_units_mesh(dense_mesh: DeviceMesh) -> DeviceMesh:
    """`(dp_replicate, dp_cp_shard_tp)`: where the MoE blocks are sharded under tp without ep."""
    return fold_tp_into_shard(dense_mesh)


def check_qwen3_tp_degrees(params: Qwen3DenseParameters, tp: int, *, seq_len: int | None = None) -> None:
    """Fail unless every split dimension of the model (and `seq_len`, when given: sequence parallelism splits it)
    divides by `tp`; the stage preflight calls this before any rank starts.

    Raises:
        ValueError: naming each dimension that does not divide and the `tp` degrees that would be valid.
    """
    if tp <= 1:
        return
    dims = {
        "num_attention_heads": params.num_attention_heads,
        "num_key_value_heads": params.num_key_value_heads,
        "vocab_size": params.vocab_size,
    }
    if not isinstance(params, Qwen3MoeParameters) or any(
        not params.is_moe_layer(index) for index in range(params.num_layers)
    ):
        dims["intermediate_size"] = params.intermediate_size
    checked = dims if seq_len is None else {**dims, "seq_len": seq_len}
    bad = {name: size for name, size in checked.items() if size % tp != 0}
    problems = [f"{name}={size}" for name, size in bad.items()]
    if len(params.segments()) > 1:
        problems.append(f"vocab_segments={params.segments()} (several segments; tp needs one)")
    if problems:
        common = math.gcd(*checked.values())
        valid = [degree for degree in range(1, common + 1) if common % degree == 0]
        raise ValueError(
            f"tp={tp} does not fit the model: {', '.join(problems)} must be divisible by tp "
            f"(key/value heads are not replicated across tp ranks); valid tp degrees: {valid}."
        )


def _params_of(model: nn.Module) -> Qwen3DenseParameters:
    for module in model.modules():
        params = getattr(module, "params", None)
        if isinstance(params, Qwen3DenseParameters):
            return params
    raise ValueError(f"{type(model).__name__} holds no Qwen3 parameters (a backbone with `.params`)")


def _check_covered(model: nn.Module, local_regions: list[nn.Module]) -> None:
    local = {id(param) for region in local_regions for param in region.parameters()}
    missed = [
        name for name, param in model.named_parameters() if not isinstance(param, DTensor) and id(param) not in local
    ]
    if missed:
        raise ValueError(f"the tensor-parallel plan left parameters unsplit and unreplicated: {missed}")
