"""Batched non-blocking point-to-point messages of a pipeline group (gloo on CPU, NCCL on GPU)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class PendingBatch:
    """Requests of one `batch_isend_irecv`, waited at most once (gloo hangs on a second wait of a P2P request)."""

    works: list[dist.Work]
    done: bool = False

    def wait(self) -> None:
        if not self.done:
            for work in self.works:
                work.wait()
            self.done = True


@dataclass
class ReceiveHandle:
    """A posted receive; waiting on it waits for the batch it went out in."""

    batch: PendingBatch | None = None

    def wait(self) -> None:
        if self.batch is None:
            raise RuntimeError("waiting for a receive that was never issued (flush the communicator first)")
        self.batch.wait()


@dataclass
class Communicator:
    """Collects consecutive sends and receives and issues them as one batch (peers are pipeline ranks)."""

    group: dist.ProcessGroup
    _ops: list[dist.P2POp] = field(default_factory=list)
    _handles: list[ReceiveHandle] = field(default_factory=list)  # receives of the batch being collected
    _issued: list[PendingBatch] = field(default_factory=list)

    def _peer(self, pipeline_rank: int) -> int:
        return dist.get_global_rank(self.group, pipeline_rank)

    def send(self, tensor: torch.Tensor, pipeline_rank: int) -> None:
        self._ops.append(dist.P2POp(dist.isend, tensor, self._peer(pipeline_rank), group=self.group))

    def recv(self, buffer: torch.Tensor, pipeline_rank: int) -> ReceiveHandle:
        self._ops.append(dist.P2POp(dist.irecv, buffer, self._peer(pipeline_rank), group=self.group))
        handle = ReceiveHandle()
        self._handles.append(handle)
        return handle

    def flush(self) -> None:
        if not self._ops:
            return
        batch = PendingBatch(works=[work for work in dist.batch_isend_irecv(self._ops) if work is not None])
        for handle in self._handles:
            handle.batch = batch
        self._issued.append(batch)
        self._ops, self._handles = [], []

    def wait_all(self) -> None:
        self.flush()
        for batch in self._issued:
            batch.wait()
        self._issued.clear()
