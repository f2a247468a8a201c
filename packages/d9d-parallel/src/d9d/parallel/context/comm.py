"""The collectives context parallelism needs, on any backend (gloo has no reduce-scatter: all-reduce and slice)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from d9d.parallel.context.layout import shard_sequence, unshard_sequence


class RingExchange:
    """Send a tensor to the next rank of `group` and receive the previous rank's, asynchronously."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        rank, size = group.rank(), group.size()
        self.next_rank = dist.get_global_rank(group, (rank + 1) % size)
        self.prev_rank = dist.get_global_rank(group, (rank - 1) % size)

    def start(self, tensor: torch.Tensor) -> tuple[torch.Tensor, list[dist.Work]]:
        """Begin the exchange; returns the receive buffer and the requests to wait on before reading it."""
        received = torch.empty_like(tensor)
        ops = [
            dist.P2POp(dist.isend, tensor.contiguous(), self.next_rank, self.group),
            dist.P2POp(dist.irecv, received, self.prev_rank, self.group),
        ]
        return received, dist.batch_isend_irecv(ops)


def finish(requests: list[dist.Work]) -> None:
    for request in requests:
        request.wait()


def all_gather_sequence(tensor: torch.Tensor, group: dist.ProcessGroup, dim: int = 1) -> torch.Tensor:
    """Every rank's shard of the load-balanced layout, joined into the full sequence in global order."""
    shards = [torch.empty_like(tensor) for _ in range(group.size())]
    dist.all_gather(shards, tensor.contiguous(), group=group)
    return unshard_sequence(shards, dim=dim)


def reduce_scatter_sequence(tensor: torch.Tensor, group: dist.ProcessGroup, dim: int = 1) -> torch.Tensor:
    """Sum full-sequence tensors over `group` and keep this rank's shard (the transpose of the gather)."""
    rank, size = group.rank(), group.size()
    if dist.get_backend(group) == "gloo":
        summed = tensor.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(summed, group=group)
        return shard_sequence(summed, rank, size, dim=dim)
    pieces = torch.cat([shard_sequence(tensor, peer, size, dim=dim) for peer in range(size)], dim=0).contiguous()
    local = torch.empty_like(shard_sequence(tensor, rank, size, dim=dim))
    dist.reduce_scatter_tensor(local, pieces, group=group)
    return local
