"""The fork-based rank harness: results come back by rank, failures and deadlocks become clear test failures."""

import time

import pytest
import torch
import torch.distributed as dist

from d9d.core.testing import RankFailure, RankTimeout, run_on_ranks


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_every_rank_runs_in_a_real_gloo_group(world_size):
    def body():
        assert dist.get_backend() == "gloo"
        value = torch.tensor([dist.get_rank() + 1.0])
        dist.all_reduce(value)
        return dist.get_rank(), dist.get_world_size(), value.item()

    results = run_on_ranks(world_size, body)
    expected_sum = world_size * (world_size + 1) / 2
    assert results == [(rank, world_size, expected_sum) for rank in range(world_size)]


def test_four_rank_test_is_fast_after_warm_up():
    # Not a benchmark: a coarse guard that the warm-fork design is in use (a cold spawn costs 10-20 s here).
    run_on_ranks(4, lambda: dist.barrier())
    start = time.perf_counter()
    run_on_ranks(4, lambda: dist.barrier())
    assert time.perf_counter() - start < 5.0


def test_a_failing_rank_fails_with_its_traceback():
    def body():
        if dist.get_rank() == 2:
            raise ValueError("rank two is broken on purpose")
        dist.barrier()  # the healthy ranks block here until the harness kills them

    with pytest.raises(RankFailure) as failure:
        run_on_ranks(4, body, timeout_seconds=30)
    message = str(failure.value)
    assert "rank 2 raised" in message
    assert "ValueError: rank two is broken on purpose" in message
    assert "test_harness.py" in message


def test_a_rank_that_raises_then_hangs_in_teardown_still_reports_its_error():
    """NCCL's destroy_process_group can block while the peers wait in a collective the failed rank never joins; the
    rank's error must come back (quickly, not after the timeout) rather than die with the killed rank."""

    def body():
        if dist.get_rank() == 0:
            dist.destroy_process_group = lambda *args, **kwargs: time.sleep(60)  # this rank's teardown hangs
            raise ValueError("rank zero fails before the broadcast")
        dist.barrier()  # rank 1 waits for a rank that is gone

    start = time.perf_counter()
    with pytest.raises(RankFailure) as failure:
        run_on_ranks(2, body, timeout_seconds=40)
    assert time.perf_counter() - start < 20
    assert "rank zero fails before the broadcast" in str(failure.value)


def test_a_deadlock_fails_after_the_timeout_with_each_rank_stack():
    def body():
        if dist.get_rank() == 0:
            dist.barrier()  # rank 1 never joins
        else:
            time.sleep(60)

    start = time.perf_counter()
    with pytest.raises(RankTimeout) as timeout:
        run_on_ranks(2, body, timeout_seconds=2)
    assert time.perf_counter() - start < 10
    message = str(timeout.value)
    assert "did not finish within 2s" in message
    assert "rank 0 was still running" in message
    assert "rank 1 was still running" in message
    assert "in body" in message  # faulthandler's stack names the function each rank was stuck in


def test_a_rank_that_exits_hard_is_reported():
    import os

    def body():
        if dist.get_rank() == 1:
            os._exit(3)

    with pytest.raises((RankFailure, RankTimeout), match="rank 1"):
        run_on_ranks(2, body, timeout_seconds=10)


@pytest.mark.distributed(world_size=4)
def test_the_marker_runs_the_test_body_on_every_rank():
    assert dist.get_world_size() == 4
    gathered = [None] * 4
    dist.all_gather_object(gathered, dist.get_rank())
    assert gathered == [0, 1, 2, 3]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.distributed
def test_the_marker_takes_world_size_from_a_parameter(world_size):
    assert dist.get_world_size() == world_size


def test_refuses_to_fork_while_holding_a_process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="holds a process group"):
            run_on_ranks(2, lambda: None)
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
def test_gpu_marked_tests_skip_without_cuda():
    assert torch.cuda.is_available()


def test_a_crashing_rank_reports_its_stack():
    import ctypes

    def body():
        if dist.get_rank() == 1:
            ctypes.string_at(0)  # a deliberate segmentation fault
        dist.barrier()

    with pytest.raises(RankFailure) as failure:
        run_on_ranks(2, body, timeout_seconds=20)
    message = str(failure.value)
    assert "rank 1 exited with code -11" in message
    assert "Fatal Python error: Segmentation fault" in message
