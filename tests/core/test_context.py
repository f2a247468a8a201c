"""The distributed context on real gloo groups: meshes, coordinates, ordering helpers, timeouts and teardown."""

import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from d9d.core.dist import (
    DistributedContext,
    LaunchEnvironment,
    MeshDegrees,
    MeshDomain,
    moves_cpu_tensors,
    resolve_device_type,
)
from d9d.core.testing import RankFailure, run_on_ranks


@pytest.mark.distributed(world_size=4)
def test_four_ranks_build_every_domain_with_consistent_coordinates():
    ctx = DistributedContext.build(MeshDegrees(dp_replicate=2, dp_shard=2, ep=2))
    assert ctx.device == torch.device("cpu")
    assert ctx.mesh_for(MeshDomain.REGULAR).mesh_dim_names == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    assert tuple(ctx.mesh_for("dense").shape) == (1, 2, 2, 1)
    assert tuple(ctx.mesh_for("expert").shape) == (1, 2, 2, 1)
    assert tuple(ctx.mesh_for("flat").shape) == (4,)
    for domain in MeshDomain:
        mesh_coordinate = ctx.mesh_for(domain).get_coordinate()
        assert list(mesh_coordinate or ()) == list(ctx.coordinate(domain).values()), domain
    # a collective over one named dimension reaches exactly the ranks of that dimension
    value = torch.tensor([float(ctx.rank)])
    dist.all_reduce(value, group=ctx.mesh_for("regular").get_group("dp_shard"))
    expected = {0: 1.0, 1: 1.0, 2: 5.0, 3: 5.0}[ctx.rank]
    assert value.item() == expected
    ep_value = torch.tensor([float(ctx.rank)])
    dist.all_reduce(ep_value, group=ctx.mesh_for("expert").get_group("ep"))
    assert ep_value.item() == expected  # ep=2 folds over the two dp_shard neighbours
    assert ctx.logger.prefix == f"[r{ctx.rank} pp0 dpr{ctx.rank // 2} dps{ctx.rank % 2} cp0 tp0]"
    assert ctx.is_main_process == (ctx.rank == 0)
    ctx.close()


@pytest.mark.distributed(world_size=8, timeout=120)
def test_eight_ranks_pipeline_and_tensor_parallel_coordinates():
    ctx = DistributedContext.build(MeshDegrees(pp=2, dp_shard=2, tp=2))
    assert ctx.pp_rank == ctx.rank // 4
    assert ctx.coordinate("batch") == {"pp": ctx.rank // 4, "dp": (ctx.rank // 2) % 2, "cp": 0, "tp": ctx.rank % 2}


def _clear_launch_env():
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(name, None)


def test_a_single_process_without_launcher_gets_a_world_of_one():
    def body():
        _clear_launch_env()
        with DistributedContext.build() as ctx:
            assert dist.is_initialized()
            assert (ctx.rank, ctx.world_size) == (0, 1)
            assert tuple(ctx.mesh_for("dense").shape) == (1, 1, 1, 1)
        assert not dist.is_initialized()
        ctx.close()  # closing twice is harmless

    run_on_ranks(1, body, init_process_group=False)


def test_context_initialises_from_torchrun_environment_and_tears_down():
    def body():
        ctx = DistributedContext.build(MeshDegrees(dp_shard=2))
        assert dist.get_world_size() == 2
        ctx.close()
        return dist.is_initialized()

    assert run_on_ranks(2, body, init_process_group=False) == [False, False]


def test_environment_that_does_not_match_the_degrees_is_a_clear_error():
    def body():
        DistributedContext.build(MeshDegrees(dp_shard=3))

    with pytest.raises(
        RankFailure, match=r"mesh degrees multiply to 3 but the world size is 2 \(pp=1, dp_replicate=1, dp_shard=3"
    ):
        run_on_ranks(2, body, init_process_group=False)


def test_incomplete_launcher_environment_is_a_clear_error():
    with pytest.raises(ValueError, match="LOCAL_RANK set but RANK and WORLD_SIZE are both needed"):
        LaunchEnvironment.from_environ({"LOCAL_RANK": "0"})
    with pytest.raises(ValueError, match="RANK=5 is outside"):
        LaunchEnvironment.from_environ({"RANK": "5", "WORLD_SIZE": "4"})
    with pytest.raises(ValueError, match="WORLD_SIZE='four' is not an integer"):
        LaunchEnvironment.from_environ({"RANK": "0", "WORLD_SIZE": "four"})


def test_device_choice_is_explicit_then_environment_then_detected(monkeypatch):
    monkeypatch.setenv("D9D_DEVICE", "cpu")
    assert resolve_device_type() == "cpu"
    monkeypatch.setenv("D9D_DEVICE", "tpu")
    with pytest.raises(ValueError, match="D9D_DEVICE='tpu' is not a device choice; valid: 'auto', 'cpu', 'cuda'"):
        resolve_device_type()
    assert resolve_device_type("cpu") == "cpu"
    monkeypatch.delenv("D9D_DEVICE")
    assert resolve_device_type() == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no CUDA device is visible"):
            resolve_device_type("cuda")


@pytest.mark.distributed(world_size=4)
def test_main_process_first_runs_rank_zero_before_the_others():
    ctx = DistributedContext.build()
    shared = Path("/tmp") / f"d9d-main-first-{os.getppid()}"
    if ctx.is_main_process:
        shared.write_text("")
    ctx.barrier()
    with ctx.main_process_first():
        if ctx.is_main_process:
            time.sleep(0.2)  # rank 0 is slow on purpose: the others must still come after it
        with shared.open("a") as file:
            file.write(f"{ctx.rank}\n")
    ctx.barrier()
    order = shared.read_text().split()
    assert order[0] == "0" and sorted(order) == ["0", "1", "2", "3"]
    ctx.barrier()
    if ctx.is_main_process:
        shared.unlink()


@pytest.mark.distributed(world_size=4)
def test_local_main_process_first_orders_each_node():
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    os.environ["LOCAL_RANK"] = str(dist.get_rank() % 2)
    ctx = DistributedContext.build()
    assert (ctx.num_nodes, ctx.node_rank) == (2, ctx.rank // 2)
    shared = Path("/tmp") / f"d9d-local-first-{os.getppid()}-{ctx.node_rank}"
    if ctx.is_local_main_process:
        shared.write_text("")
    ctx.barrier()
    with ctx.local_main_process_first():
        if ctx.is_local_main_process:
            time.sleep(0.2)
        with shared.open("a") as file:
            file.write(f"{ctx.rank}\n")
    ctx.barrier()
    assert shared.read_text().split()[0] == str(ctx.node_rank * 2)
    ctx.barrier()
    if ctx.is_local_main_process:
        shared.unlink()


def test_collective_timeout_is_configurable():
    def body():
        ctx = DistributedContext.build(timeout=timedelta(seconds=1))
        if ctx.rank == 1:
            dist.barrier()  # rank 0 never joins: this must fail after about a second, not hang
        else:
            time.sleep(5)

    start = time.perf_counter()
    with pytest.raises(RankFailure, match="rank 1 raised"):
        run_on_ranks(2, body, init_process_group=False, timeout_seconds=30)
    assert time.perf_counter() - start < 20


def test_a_world_of_one_has_no_control_group():
    def body():
        _clear_launch_env()
        with DistributedContext.build() as ctx:
            return ctx.control_group is None

    assert run_on_ranks(1, body, init_process_group=False) == [True]


@pytest.mark.distributed(world_size=2)
def test_the_control_group_all_reduces_cpu_tensors_over_every_rank():
    ctx = DistributedContext.build(MeshDegrees(dp_shard=2))
    group = ctx.control_group
    assert group is not None
    assert group.size() == 2
    assert group == dist.group.WORLD  # the harness's gloo default group already moves CPU tensors: no new group
    assert moves_cpu_tensors() and moves_cpu_tensors(ctx.mesh_for(MeshDomain.BATCH).get_group("dp"))
    flag = torch.tensor([ctx.rank + 1], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    assert flag.item() == 2


@pytest.mark.distributed(world_size=2)
def test_a_default_group_without_gloo_gets_a_gloo_control_group():
    # What a launcher's plain `nccl` default group gets; built here over the harness's gloo world (no NCCL on a CPU).
    from d9d.core.dist.context import _host_control_group

    group = _host_control_group(False, timedelta(seconds=30))
    assert group != dist.group.WORLD
    assert dist.get_backend(group) == "gloo"
    assert group.size() == 2
    value = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(value, group=group)
    assert value.item() == 1.0
