"""The multi-tensor stochastic AdamW step: one Triton launch for a bucket of parameters (d9d-core's
`FusedStochasticAdamWMultiStep`).

The kernel finds its tensors through a device table of addresses (int64 `data_ptr`s, cast to typed pointers in the
kernel; Triton's CPU interpreter supports that cast too, over host addresses), so one launch covers tensors of any
sizes. Two device tensors per call:

- the table: per tensor its four addresses, its element count and its three seeds. Uploaded every call (one small
  copy from pinned memory): `zero_grad(set_to_none=True)` reallocates the gradients, so addresses change;
- the block map: per program, which tensor and which block of it. It depends only on the element counts, so it is
  cached, keyed on them.

The block size is fixed, not autotuned: Triton's tuner restores in-place outputs between its trials only for tensor
arguments, and here the outputs are reached through addresses, so tuning would apply the update several times.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from d9d.core.optim import AdamWStepParameters
from d9d.kernels.triton_support import interpreting

# 4096 elements in 8 warps: 16 per thread (the per-tensor kernel's largest config; its tuner picks it at the anchor
# sizes). Under the interpreter, whose cost is per program, the per-tensor kernel's first config (the tests shrink it
# so that their small tensors span several blocks).
BLOCK, NUM_WARPS = 4096, 8
INTERPRETER_BLOCK = 1024
_CACHED_BLOCK_MAPS = 32


def default_block() -> int:
    return INTERPRETER_BLOCK if interpreting() else BLOCK


_block_maps: dict[tuple[tuple[int, ...], int, torch.device], torch.Tensor] = {}


def block_map(numels: tuple[int, ...], block: int, device: torch.device) -> torch.Tensor:
    """int32 (blocks, 2): for each program, its tensor's index in the bucket and its block within that tensor."""
    key = (numels, block, device)
    cached = _block_maps.get(key)
    if cached is not None:
        return cached
    counts = torch.tensor([-(-numel // block) for numel in numels], dtype=torch.int64)
    tensors = torch.repeat_interleave(torch.arange(len(numels)), counts)
    starts = torch.cumsum(counts, 0) - counts
    blocks = torch.arange(len(tensors)) - torch.repeat_interleave(starts, counts)
    mapping = torch.stack([tensors, blocks], dim=1).to(torch.int32).to(device)
    if len(_block_maps) >= _CACHED_BLOCK_MAPS:  # a handful of buckets per model; bounded in case sizes vary
        del _block_maps[next(iter(_block_maps))]
    _block_maps[key] = mapping
    return mapping


def stochastic_adamw_multi_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    hyper: AdamWStepParameters,
    seeds: Sequence[tuple[int, int, int]],
    block: int | None = None,
) -> None:
    """Update every `(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i])` with `seeds[i]` in one launch, bit for bit
    as `stochastic_adamw_step` on each. `block`: elements per program (default `default_block()`)."""
    from d9d.kernels.adamw.triton_kernels import launch_multi, seed32

    count = len(params)
    if not count == len(grads) == len(exp_avgs) == len(exp_avg_sqs) == len(seeds):
        raise ValueError(
            f"the multi-tensor AdamW step needs one grad, two moments and a seed triple per parameter; got "
            f"{count} params, {len(grads)} grads, {len(exp_avgs)} exp_avgs, {len(exp_avg_sqs)} exp_avg_sqs and "
            f"{len(seeds)} seed triples"
        )
    if count == 0:
        return
    first = (params[0], grads[0], exp_avgs[0])
    dtypes = (first[0].dtype, first[1].dtype, first[2].dtype)
    device = first[0].device
    rows: list[int] = []
    numels: list[int] = []
    alignment = 0  # the OR of every address and size: its low 4 bits are zero iff all are multiples of 16
    for param, grad, exp_avg, exp_avg_sq, (seed_p, seed_m, seed_v) in zip(
        params, grads, exp_avgs, exp_avg_sqs, seeds, strict=True
    ):
        numel = param.numel()
        if (
            not (param.is_contiguous() and grad.is_contiguous() and exp_avg.is_contiguous())
            or not exp_avg_sq.is_contiguous()
            or not numel == grad.numel() == exp_avg.numel() == exp_avg_sq.numel()
            or (param.dtype, grad.dtype, exp_avg.dtype) != dtypes
            or exp_avg_sq.dtype != dtypes[2]
            or param.device != device
            or grad.device != device
        ):
            _raise_mismatch((param, grad, exp_avg, exp_avg_sq), dtypes, device)
        addresses = (param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr())
        alignment |= addresses[0] | addresses[1] | addresses[2] | addresses[3] | numel
        rows.extend(addresses)
        rows.extend((numel, seed32(seed_p), seed32(seed_m), seed32(seed_v)))
        numels.append(numel)
    if not any(numels):
        return
    chosen = block or default_block()
    mapping = block_map(tuple(numels), chosen, device)
    on_gpu = device.type == "cuda"
    table = torch.empty(len(rows), dtype=torch.int64, pin_memory=on_gpu)
    table.numpy()[:] = rows  # a third of `torch.tensor(rows)`'s host time
    if on_gpu:
        table = table.to(device, non_blocking=True)  # the pinned buffer stays reserved until the copy has run
    launch_multi(
        table, mapping, hyper, dtypes, aligned=alignment % 16 == 0, block=chosen, num_warps=NUM_WARPS
    )  # fmt: skip


def _raise_mismatch(
    tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    dtypes: tuple[torch.dtype, torch.dtype, torch.dtype],
    device: torch.device,
) -> None:
    described = ", ".join(
        f"{name} {tuple(tensor.shape)} {tensor.dtype} on {tensor.device} (contiguous={tensor.is_contiguous()})"
        for name, tensor in zip(("param", "grad", "exp_avg", "exp_avg_sq"), tensors, strict=True)
    )
    raise ValueError(
        "the multi-tensor AdamW step needs, per parameter, contiguous tensors of one size, and one dtype per role "
        f"and one device across the bucket (param {dtypes[0]}, grad {dtypes[1]}, moments {dtypes[2]}, on {device}); "
        f"got {described}"
    )
