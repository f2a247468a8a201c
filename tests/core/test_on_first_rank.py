"""`d9d.core.dist.on_first_rank` on real gloo ranks: the action runs once, on rank 0, every rank returns only after
it, and an error it raises is raised on every rank (none is left waiting at a collective)."""

import time

import pytest
import torch.distributed as dist

from d9d.core.dist import on_first_rank


def test_in_one_process_it_just_runs_the_action():
    ran = []
    on_first_rank(lambda: ran.append(1))
    assert ran == [1]


@pytest.mark.distributed(world_size=3, timeout=60)
def test_the_action_runs_on_rank_zero_only_and_every_rank_waits_for_it(tmp_path):
    marker = tmp_path / "written"
    ran: list[int] = []

    def slow_write() -> None:
        time.sleep(0.3)  # the other ranks would read too early if they did not wait
        ran.append(dist.get_rank())
        marker.write_text(str(dist.get_rank()))

    on_first_rank(slow_write)
    assert marker.read_text() == "0"
    assert ran == ([0] if dist.get_rank() == 0 else [])


@pytest.mark.distributed(world_size=3, timeout=60)
def test_an_error_on_rank_zero_is_raised_on_every_rank():
    def fail() -> None:
        raise FileNotFoundError("no such source: /nowhere")

    with pytest.raises(FileNotFoundError, match="no such source: /nowhere"):
        on_first_rank(fail)
    dist.barrier()  # the group still works afterwards
