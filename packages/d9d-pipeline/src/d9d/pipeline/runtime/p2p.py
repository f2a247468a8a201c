"""Non-blocking point-to-point messages of a pipeline group (gloo on CPU, NCCL on GPU).

Every send and receive is posted on its own. Batching them (`batch_isend_irecv`) couples their completion: waiting
for a batch's receive would also wait for its sends, and a send completes only once the peer posts the matching
receive, which a valid program may do only after this rank's receive has been consumed (a deadlock the programs'
semantics do not have). Receives are waited when their tensor is needed, sends at the end of the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class ReceiveHandle:
    """A posted receive, waited at most once (gloo hangs on a second wait of a point-to-point request)."""

    work: dist.Work | None
    done: bool = False

    def wait(self) -> None:
        if not self.done and self.work is not None:
            self.work.wait()
        self.done = True


@dataclass
class Communicator:
    group: dist.ProcessGroup
    _sends: list[tuple[dist.Work | None, torch.Tensor]] = field(default_factory=list)

    def _peer(self, pipeline_rank: int) -> int:
        return dist.get_global_rank(self.group, pipeline_rank)

    def send(self, tensor: torch.Tensor, pipeline_rank: int) -> None:
        # The tensor is kept until the send completes: it may be the only reference to a gradient.
        self._sends.append((dist.isend(tensor, self._peer(pipeline_rank), group=self.group), tensor))

    def recv(self, buffer: torch.Tensor, pipeline_rank: int) -> ReceiveHandle:
        return ReceiveHandle(dist.irecv(buffer, self._peer(pipeline_rank), group=self.group))

    def wait_all(self) -> None:
        for work, _ in self._sends:
            if work is not None:
                work.wait()
        self._sends.clear()
