"""The same distributed core on CUDA + NCCL (run on the GPU machine; skipped cleanly without a GPU)."""

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor

from d9d.core.determinism import init_parameter_, seed_everything
from d9d.core.dist import DistributedContext, MeshDegrees
from d9d.core.ops import all_gather_object, all_gather_variable_shape
from d9d.core.testing import gpu_world_size, run_on_ranks

pytestmark = pytest.mark.gpu


def test_nccl_context_collectives_and_variable_shape_gather():
    world = gpu_world_size()

    def body():
        os.environ["D9D_DEVICE"] = "cuda"
        with DistributedContext.build(MeshDegrees(dp_shard=-1)) as ctx:
            assert ctx.device == torch.device("cuda", ctx.rank)
            assert "nccl" in str(dist.get_backend())
            value = torch.ones(1, device=ctx.device)
            dist.all_reduce(value)
            assert value.item() == ctx.world_size
            rows = all_gather_variable_shape(torch.full((ctx.rank + 1, 3), float(ctx.rank), device=ctx.device))
            assert [r.shape[0] for r in rows] == list(range(1, ctx.world_size + 1))
            assert all_gather_object(ctx.rank) == list(range(ctx.world_size))
            return ctx.world_size

    assert run_on_ranks(world, body, init_process_group=False, timeout_seconds=120) == [world] * world


def test_cuda_sharded_init_equals_single_device_init():
    world = gpu_world_size()

    def body():
        os.environ["D9D_DEVICE"] = "cuda"
        with DistributedContext.build() as ctx:
            seed_everything(5, ctx)
            sharded = distribute_tensor(torch.zeros(64, 32, device=ctx.device), ctx.mesh_for("flat"), [Shard(0)])
            init_parameter_(sharded, nn.init.normal_)
            full = sharded.full_tensor()
            torch.manual_seed(5)
            reference = torch.empty(64, 32, device=ctx.device)
            nn.init.normal_(reference)
            # DTensor's offset-based CUDA RNG reproduces the single-device stream exactly
            return bool(torch.equal(full, reference))

    assert run_on_ranks(world, body, init_process_group=False, timeout_seconds=120) == [True] * world


def test_preemption_agreement_never_synchronises_the_gpu():
    """SIGTERM on the last rank alone is agreed by every rank over the control group (gloo beside NCCL), with CUDA's
    sync debug mode set to raise: the agreement reads no device tensor (the old one `.item()`-ed a CUDA flag)."""
    import signal

    from d9d.core.loop.preemption import PreemptionFlag

    world = gpu_world_size()

    def body():
        os.environ["D9D_DEVICE"] = "cuda"
        with DistributedContext.build(MeshDegrees(dp_shard=-1)) as ctx:
            torch.ones(1, device=ctx.device)  # CUDA initialised, so the debug mode has something to watch
            flag = PreemptionFlag()
            flag.install()
            try:
                torch.cuda.set_sync_debug_mode("error")
                before = flag.agreed(ctx.control_group)
                if ctx.rank == ctx.world_size - 1:
                    os.kill(os.getpid(), signal.SIGTERM)
                after = flag.agreed(ctx.control_group)
            finally:
                torch.cuda.set_sync_debug_mode(0)
                flag.uninstall()
            return before, after, ctx.control_group is None

    results = run_on_ranks(world, body, init_process_group=False, timeout_seconds=120)
    assert results == [(False, True, world == 1)] * world


def test_token_count_sum_over_nccl_ranks_never_synchronises_the_gpu():
    """The Trainer's per-step sums (`sum_over` on the token group) go through gloo on the host: the groups of the
    context's meshes inherit its `cpu:gloo,cuda:nccl` backends, so no device tensor is read back."""
    from d9d.core.dist import moves_cpu_tensors
    from d9d.core.loop.reduce import sum_over, token_group

    world = gpu_world_size()
    if world < 2:
        pytest.skip("needs 2 GPUs: one process has no token group")

    def body():
        os.environ["D9D_DEVICE"] = "cuda"
        with DistributedContext.build(MeshDegrees(dp_shard=-1)) as ctx:
            group = token_group(ctx)
            torch.ones(1, device=ctx.device)
            torch.cuda.set_sync_debug_mode("error")
            try:
                sums = sum_over([float(ctx.rank), 2.0**50 + 1], group, ctx.device)
            finally:
                torch.cuda.set_sync_debug_mode(0)
            return moves_cpu_tensors(group), sums

    results = run_on_ranks(world, body, init_process_group=False, timeout_seconds=120)
    expected = [float(sum(range(world))), world * (2.0**50 + 1)]
    assert results == [(True, expected)] * world
