"""The pipeline's point-to-point channels (design 0026): messages to a higher pipeline rank travel on the pipeline
group, messages to a lower one on its twin, so the two directions between two ranks never share a communicator
(on NCCL, a stream). Real gloo groups over three forked ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist

from d9d.core.dist import DistributedContext, MeshDegrees
from d9d.core.testing import run_on_ranks
from d9d.pipeline import pipeline_group, pipeline_upstream_group
from d9d.pipeline.runtime.p2p import Communicator


def test_each_direction_travels_on_its_own_group():
    """Rank 1 sends to both neighbours through the `Communicator`; each neighbour receives with a raw `irecv` on the
    group that direction must use. Had a message gone on the other group, its receive would never complete and the
    ranks would time out. The reverse direction goes through the `Communicator` on both ends, receives posted before
    the sends they pair with."""

    def body() -> list[float]:
        group = dist.new_group([0, 1, 2])
        twin = dist.new_group([0, 1, 2])  # what `pipeline_upstream_group` makes: the same ranks again
        comm = Communicator(group, twin)
        rank = dist.get_rank()
        got: list[float] = []
        if rank == 1:
            comm.send(torch.full((4,), 10.0), 2)  # down the pipeline: `group`
            comm.send(torch.full((4,), 20.0), 0)  # up: the twin
            handles = [(buffer, comm.recv(buffer, peer)) for peer, buffer in ((0, torch.empty(4)), (2, torch.empty(4)))]
            for buffer, handle in handles:
                handle.wait()
                got.append(float(buffer[0]))
        else:
            buffer = torch.empty(4)
            dist.irecv(buffer, 1, group=group if rank == 2 else twin).wait()
            got.append(float(buffer[0]))
            comm.send(torch.full((4,), 100.0 + rank), 1)
        comm.wait_all()
        return got

    assert run_on_ranks(3, body, timeout_seconds=60) == [[20.0], [100.0, 102.0], [10.0]]


def test_upstream_group_holds_this_ranks_pipeline_ranks_under_pp_x_dp():
    """pp=2 x dp_shard=2 over four ranks: every rank's second group holds exactly its pipeline group's ranks (the
    groups are created by every rank in one order, so building a schedule twice in a process works too)."""

    def body() -> list[list[int]]:
        ctx = DistributedContext.build(MeshDegrees(pp=2, dp_shard=2), device="cpu")  # type: ignore[arg-type]
        try:
            seen = []
            for _ in range(2):
                group, upstream = pipeline_group(ctx), pipeline_upstream_group(ctx)
                assert group is not None and upstream is not None and upstream is not group
                seen.append(dist.get_process_group_ranks(upstream))
                assert seen[-1] == dist.get_process_group_ranks(group)
            return seen
        finally:
            ctx.close()

    results = run_on_ranks(4, body, timeout_seconds=120, init_process_group=False)
    assert all(len(ranks) == 2 and sorted(ranks) == ranks for seen in results for ranks in seen)
    assert results[0][0] != results[1][0]  # ranks 0 and 1 sit in different pipelines
