"""Vocabulary parallelism: the embedding table and the LM head split by vocabulary rows over the `tp` ranks.

The loss is the chunked linear cross-entropy of `d9d.models` computed on the vocabulary-sharded logits: every rank
forms the logits of a chunk of tokens against its own `vocab/tp` rows only, and three `(chunk,)` all-reduces (row
max, sum of exponentials, target logit) give the exact log-sum-exp and loss. Backward recomputes the chunk's local
logits. No rank ever holds a full-vocabulary logit row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)

from d9d.parallel.tensor.styles import SEQUENCE

IGNORE_INDEX = -100


def parallelize_vocab_embedding(module: nn.Module, mesh: DeviceMesh, *, output: Placement = SEQUENCE) -> None:
    """Split the token table of `module` by rows over the 1-D `mesh`; `(batch, seq)` ids in, activations placed as
    `output` out: `Shard(1)` (sequence parallel; `seq` must divide by the mesh size) or `Replicate()` (any `seq`).

    Each rank looks up the ids of its row range (zeros elsewhere) and the partial sums are reduce-scattered along
    the sequence (or all-reduced). `module` computes `embedding(ids, weight)` from its one parameter named `weight`
    (wrappers included); a table split into several parameters (vocabulary segments) is refused.

    Raises:
        ValueError: `module` has no or several `weight` parameters, or its rows do not divide by the mesh size.
    """
    tables = [name for name, _ in module.named_parameters() if name.rsplit(".", 1)[-1] == "weight"]
    if len(tables) != 1:
        raise ValueError(
            f"parallelize_vocab_embedding needs one token table, got weights {tables}: several vocabulary segments "
            "are not supported with tp > 1; merge them into one segment (vocab_segments=None)."
        )
    _check_rows(module.get_parameter(tables[0]), mesh, "embedding")

    def partition(_name: str, sub: nn.Module, sub_mesh: DeviceMesh) -> None:
        for name, param in list(sub.named_parameters(recurse=False)):
            placement = Shard(0) if name == "weight" else Replicate()
            distributed = distribute_tensor(param, sub_mesh, [placement], src_data_rank=None)
            sub.register_parameter(name, nn.Parameter(distributed, requires_grad=param.requires_grad))

    def ids_in(_module: nn.Module, inputs: tuple[Any, ...], sub_mesh: DeviceMesh) -> Any:  # torch types it None
        ids = inputs[0]
        splits_sequence = output == SEQUENCE
        if splits_sequence and isinstance(ids, torch.Tensor) and ids.ndim >= 2 and ids.shape[1] % sub_mesh.size():
            raise ValueError(
                f"sequence length {ids.shape[1]} is not divisible by tp={sub_mesh.size()}: sequence parallelism "
                f"splits every sequence evenly over the tp ranks; pad or pack to a multiple of {sub_mesh.size()}."
            )
        if isinstance(ids, torch.Tensor) and not isinstance(ids, DTensor):
            ids = DTensor.from_local(ids, sub_mesh, (Replicate(),), run_check=False)
        return (ids, *inputs[1:])

    def placed_out(_module: nn.Module, looked_up: Any, _mesh: DeviceMesh) -> Any:
        return looked_up.redistribute(placements=(output,)) if isinstance(looked_up, DTensor) else looked_up

    distribute_module(module, mesh, partition_fn=partition, input_fn=ids_in, output_fn=placed_out)


def parallelize_vocab_head(module: nn.Module, mesh: DeviceMesh) -> None:
    """Split the LM head's `weight` by vocabulary rows; its forward uses `vocab_parallel_cross_entropy` and
    `vocab_parallel_logits` when it sees a DTensor weight.

    Raises:
        ValueError: `module` has no or several `weight` parameters, or its rows do not divide by the mesh size.
    """
    weights = [name for name, _ in module.named_parameters() if name.rsplit(".", 1)[-1] == "weight"]
    if len(weights) != 1:
        raise ValueError(
            f"parallelize_vocab_head needs one head weight, got {weights}: several vocabulary segments are not "
            "supported with tp > 1; merge them into one segment (vocab_segments=None)."
        )
    _check_rows(module.get_parameter(weights[0]), mesh, "LM head")

    def partition(_name: str, sub: nn.Module, sub_mesh: DeviceMesh) -> None:
        for name, param in list(sub.named_parameters(recurse=False)):
            placement = Shard(0) if name in ("weight", "lora_B") else Replicate()
            distributed = distribute_tensor(param, sub_mesh, [placement], src_data_rank=None)
            sub.register_parameter(name, nn.Parameter(distributed, requires_grad=param.requires_grad))

    distribute_module(module, mesh, partition_fn=partition)


def _check_rows(weight: torch.Tensor, mesh: DeviceMesh, what: str) -> None:
    if weight.shape[0] % mesh.size() != 0:
        raise ValueError(
            f"the {what} has {weight.shape[0]} vocabulary rows, not divisible by tp={mesh.size()}; "
            "use a tp that divides the vocabulary size (or pad the vocabulary)."
        )


def vocab_parallel_cross_entropy(
    hidden: torch.Tensor, weight: DTensor, labels: torch.Tensor, *, chunk_size: int = 2048
) -> torch.Tensor:
    """Per-token float32 cross-entropy of `hidden @ weight.T` with `weight` `(vocab, H)` split `Shard(0)` over a 1-D
    mesh; shaped like `labels` (identical on every rank of the mesh), 0 where a label is `IGNORE_INDEX`.

    `hidden` `(..., H)` is a DTensor on the same mesh (e.g. `Shard(1)` from sequence parallelism; it is gathered)
    or a plain tensor that every rank holds whole. Its gradient is the sum of the ranks' parts.
    """
    shard = local_shard_inputs(hidden, weight, labels, chunk_size)
    losses = _VocabParallelCrossEntropy.apply(  # type: ignore[no-untyped-call]
        shard.hidden, shard.weight, shard.labels, shard.vocab_start, shard.group, chunk_size
    )
    assert isinstance(losses, torch.Tensor)
    return losses.view(labels.shape)


@dataclass(frozen=True)
class LocalShardInputs:
    """This rank's view of a vocabulary-parallel loss: flat replicated `hidden` `(N, H)` (its gradient is summed
    over the ranks), the local `weight` rows starting at `vocab_start`, flat `labels`, the tp group."""

    hidden: torch.Tensor
    weight: torch.Tensor
    labels: torch.Tensor
    vocab_start: int
    group: dist.ProcessGroup


def local_shard_inputs(
    hidden: torch.Tensor, weight: DTensor, labels: torch.Tensor, chunk_size: int
) -> LocalShardInputs:
    mesh = _vocab_mesh(weight)
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    full_hidden = _replicated_local(hidden, mesh)
    local_weight = weight.to_local()
    flat_hidden = full_hidden.reshape(-1, full_hidden.shape[-1])
    flat_labels = labels.reshape(-1)
    if flat_hidden.shape[0] != flat_labels.shape[0]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} disagree on the token count")
    return LocalShardInputs(
        hidden=flat_hidden,
        weight=local_weight,
        labels=flat_labels,
        vocab_start=mesh.get_local_rank() * local_weight.shape[0],
        group=mesh.get_group(),
    )


@torch.no_grad()
def vocab_parallel_logits(hidden: torch.Tensor, weight: DTensor) -> torch.Tensor:
    """Full-vocabulary logits `hidden @ weight.T` (inference: sampling needs every logit), a plain tensor."""
    mesh = _vocab_mesh(weight)
    local = _replicated_local(hidden, mesh) @ weight.to_local().T
    return DTensor.from_local(local, mesh, (Shard(local.ndim - 1),), run_check=False).full_tensor()


def _vocab_mesh(weight: torch.Tensor) -> DeviceMesh:
    if not isinstance(weight, DTensor) or weight.device_mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
        shown = weight.placements if isinstance(weight, DTensor) else type(weight).__name__
        raise ValueError(f"the head weight must be a DTensor split Shard(0) over a 1-D mesh, got {shown}")
    return weight.device_mesh


def _replicated_local(hidden: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    if not isinstance(hidden, DTensor):
        hidden = DTensor.from_local(hidden, mesh, (Replicate(),), run_check=False)
    if tuple(hidden.placements) != (Replicate(),):
        hidden = hidden.redistribute(placements=(Replicate(),))
    # Each rank's gradient is its vocabulary rows' part: Partial, summed by the backward of the gather.
    return hidden.to_local(grad_placements=(Partial(),))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # noqa: PLR0917 - autograd.Function.forward takes its inputs positionally
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        vocab_start: int,
        group: dist.ProcessGroup,
        chunk_size: int,
    ) -> torch.Tensor:
        tokens, local_vocab = hidden.shape[0], weight.shape[0]
        lse = torch.zeros(tokens, dtype=torch.float32, device=hidden.device)
        losses = torch.zeros_like(lse)
        valid = labels != IGNORE_INDEX
        local_targets, owned = shard_targets(labels, vocab_start, local_vocab)
        for start in range(0, tokens, chunk_size):
            stop = min(start + chunk_size, tokens)
            logits = (hidden[start:stop] @ weight.T).float()
            chunk_lse, target = chunk_lse_and_target(logits, local_targets[start:stop], owned[start:stop], group)
            lse[start:stop] = chunk_lse
            losses[start:stop] = torch.where(valid[start:stop], chunk_lse - target, 0.0)
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.vocab_start, ctx.chunk_size = vocab_start, chunk_size
        return losses

    @staticmethod
    def backward(ctx: Any, grad_losses: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, labels, lse = ctx.saved_tensors
        chunk_size: int = ctx.chunk_size
        local_targets, owned = shard_targets(labels, ctx.vocab_start, weight.shape[0])
        scale = torch.where(labels != IGNORE_INDEX, grad_losses.float(), 0.0)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, hidden.shape[0], chunk_size):
            stop = min(start + chunk_size, hidden.shape[0])
            chunk = hidden[start:stop]
            probs = torch.exp((chunk @ weight.T).float() - lse[start:stop, None])
            rows = torch.arange(stop - start, device=probs.device)
            probs[rows, local_targets[start:stop]] -= owned[start:stop].float()
            grad_logits = (probs * scale[start:stop, None]).to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[start:stop] = grad_logits @ weight  # this rank's vocabulary part of the sum
            grad_weight.add_(grad_logits.T @ chunk)
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None


def chunk_lse_and_target(
    logits: torch.Tensor, local_targets: torch.Tensor, owned: torch.Tensor, group: dist.ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole vocabulary's log-sum-exp and target logit of a chunk's float32 local logits `(rows, vocab/tp)`:
    three `(rows,)` all-reduces over the tp group (row max, rescaled sum of exponentials, target logit)."""
    row_max = logits.max(dim=-1).values
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
    sum_exp = torch.exp(logits - row_max[:, None]).sum(dim=-1)
    dist.all_reduce(sum_exp, group=group)
    target = torch.where(owned, logits.gather(1, local_targets[:, None]).squeeze(1), 0.0)
    dist.all_reduce(target, group=group)
    return row_max + torch.log(sum_exp), target


def shard_targets(labels: torch.Tensor, vocab_start: int, local_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each label as a row of this rank's slice (clamped into range) and whether this rank owns it."""
    local = labels - vocab_start
    owned = (labels != IGNORE_INDEX) & (local >= 0) & (local < local_vocab)
    return local.clamp(0, local_vocab - 1), owned
