"""Non-blocking point-to-point messages of a pipeline group (gloo on CPU, NCCL on GPU).

Every send and receive is posted on its own. Batching them (`batch_isend_irecv`) couples their completion: waiting
for a batch's receive would also wait for its sends, and a send completes only once the peer posts the matching
receive, which a valid program may do only after this rank's receive has been consumed (a deadlock the programs'
semantics do not have). Receives are waited when their tensor is needed, sends at the end of the step.

Messages travel on two process groups over the same ranks, one per direction (design 0026): to a higher pipeline rank
(activations, mostly) on `group`, to a lower one (gradients, mostly) on a second group over the same ranks
(`d9d.pipeline.build.pipeline_upstream_group`). NCCL runs all of one communicator's
operations between two ranks on one stream in issue order; with one group, a receive posted early (its data not yet
sent) held up every later send to that peer, a dependency the program does not have. With a group per direction, each
stream carries one channel, whose order the program already fixes (message `k` lands in receive `k`).
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
    group: dist.ProcessGroup  # messages to higher pipeline ranks
    upstream: dist.ProcessGroup  # the same ranks (or `group` itself): messages to lower pipeline ranks
    _sends: list[tuple[dist.Work | None, torch.Tensor]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._rank = dist.get_rank(self.group)

    def _channel(self, sender: int, receiver: int) -> dist.ProcessGroup:
        return self.group if sender < receiver else self.upstream

    def send(self, tensor: torch.Tensor, pipeline_rank: int) -> None:
        # The tensor is kept until the send completes: it may be the only reference to a gradient.
        peer = dist.get_global_rank(self.group, pipeline_rank)
        work = dist.isend(tensor, peer, group=self._channel(self._rank, pipeline_rank))
        self._sends.append((work, tensor))

    def recv(self, buffer: torch.Tensor, pipeline_rank: int) -> ReceiveHandle:
        peer = dist.get_global_rank(self.group, pipeline_rank)
        return ReceiveHandle(dist.irecv(buffer, peer, group=self._channel(pipeline_rank, self._rank)))

    def wait_all(self) -> None:
        for work, _ in self._sends:
            if work is not None:
                work.wait()
        self._sends.clear()
