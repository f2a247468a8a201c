"""Stateful data-parallel loading: a loader stopped mid-epoch resumes on any number of ranks with exactly the
samples it had not consumed."""

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from d9d.core.data import (
    DataLoaderConfig,
    DataParallelLoader,
    DataParallelStreamLoader,
    LengthBucketedOrder,
    SequentialOrder,
    ShuffledOrder,
    build_data_loader,
    epoch_batches,
)
from d9d.core.dist import DistributedContext, MeshDegrees, MeshDomain
from d9d.core.testing import run_on_ranks

NUM_SAMPLES, GLOBAL_BATCH = 103, 8


class Numbers(Dataset):
    """Sample i is the number i, with a length for bucketing."""

    lengths = np.random.default_rng(0).integers(1, 500, size=NUM_SAMPLES)

    def __len__(self):
        return NUM_SAMPLES

    def __getitem__(self, index):
        return index


ORDERS = {
    "shuffled": ShuffledOrder(NUM_SAMPLES, seed=7),
    "length-bucketed": LengthBucketedOrder(Numbers.lengths, GLOBAL_BATCH, seed=7),
}


def _phase(order_name, dp_size, steps, state, num_workers):
    """On the current ranks: resume from `state`, take `steps` steps (None: to the epoch's end)."""

    def body():
        ctx = DistributedContext.build(MeshDegrees(dp_shard=dp_size))
        dp_rank = ctx.coordinate(MeshDomain.BATCH)["dp"]
        loader = DataParallelLoader(
            Numbers(),
            order=ORDERS[order_name],
            global_batch_size=GLOBAL_BATCH,
            dp_rank=dp_rank,
            dp_size=dp_size,
            num_workers=num_workers,
        )
        if state is not None:
            loader.load_state_dict(state)
        taken = []
        for batch in loader:
            assert batch.shape == (GLOBAL_BATCH // dp_size,)
            # The step's global batch, in rank order, as the ranks see it together.
            gathered = [torch.empty_like(batch) for _ in range(dp_size)]
            dist.all_gather(gathered, batch)
            taken.append(torch.cat(gathered).tolist())
            if steps is not None and len(taken) == steps:
                break
        states = [None] * dp_size
        dist.all_gather_object(states, loader.state_dict())
        assert all(other == states[0] for other in states), f"ranks disagree on the position: {states}"
        return taken, states[0]

    taken, state = run_on_ranks(dp_size, body, timeout_seconds=60)[0]
    return [sample for batch in taken for sample in batch], state


@pytest.mark.parametrize("num_workers", [0, 2], ids=["in-process", "2-workers"])
@pytest.mark.parametrize("order_name", ["shuffled", "length-bucketed"])
def test_stopped_mid_epoch_and_resumed_on_4_then_2_ranks_yields_exactly_the_rest(order_name, num_workers):
    order = ORDERS[order_name].epoch_order(0).tolist()
    first, state = _phase(order_name, 4, 4, None, num_workers)
    assert state == {"epoch": 0, "samples_consumed": 32, "global_batch_size": GLOBAL_BATCH}
    second, state = _phase(order_name, 4, 3, state, num_workers)
    assert state["samples_consumed"] == 56
    rest, state = _phase(order_name, 2, None, state, num_workers)
    assert state == {"epoch": 1, "samples_consumed": 0, "global_batch_size": GLOBAL_BATCH}

    assert first == order[:32]
    assert second == order[32:56]
    assert rest == order[56:96], "the remaining samples, in order; the 7 that do not fill a batch are dropped"
    everything = first + second + rest
    assert len(everything) == len(set(everything)) == 96


def test_the_last_incomplete_batch_is_dropped_or_padded():
    order = SequentialOrder(10).epoch_order(0)
    assert [b.tolist() for b in epoch_batches(order, 0, 4, "drop")] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [b.tolist() for b in epoch_batches(order, 0, 4, "pad")][-1] == [8, 9, 0, 1]
    assert [b.tolist() for b in epoch_batches(order, 6, 4, "drop")] == [[6, 7, 8, 9]]


def _single(dp_rank, dp_size, **kwargs):
    return DataParallelLoader(
        Numbers(), order=SequentialOrder(NUM_SAMPLES), global_batch_size=8, dp_rank=dp_rank, dp_size=dp_size, **kwargs
    )


def test_ranks_take_consecutive_slices_and_agree_on_the_step_count():
    padded = [list(_single(rank, 4, uneven="pad")) for rank in range(4)]
    assert len({len(batches) for batches in padded}) == 1 == len(padded[0]) - 12
    assert [batch.tolist() for batch in padded[1][:2]] == [[2, 3], [10, 11]]
    assert padded[3][-1].tolist() == [102, 0], "the padded last batch repeats the epoch's first sample"


def test_position_counts_real_samples_and_rolls_over_epochs():
    loader = _single(0, 2, uneven="pad", epochs=2)
    iterator = iter(loader)
    for _ in range(13):
        next(iterator)
    assert loader.position.samples_consumed == NUM_SAMPLES, "a padded batch counts only its real samples"
    next(iterator)
    assert (loader.position.epoch, loader.position.samples_consumed) == (1, 8)
    assert len(list(iterator)) == 12
    assert loader.state_dict()["epoch"] == 2


def test_an_epoch_smaller_than_a_batch_is_an_error_not_a_silent_hang():
    loader = DataParallelLoader(Numbers(), order=SequentialOrder(5), global_batch_size=8, dp_rank=0, dp_size=1)
    with pytest.raises(ValueError, match="fewer than one global batch of 8; with uneven='drop' it would yield nothing"):
        next(iter(loader))


def test_global_batch_must_divide_over_the_ranks():
    with pytest.raises(ValueError, match=r"global_batch_size=8 does not divide over dp_size=3"):
        _single(0, 3)


def test_stream_loader_resumes_on_another_data_parallel_size():
    def open_stream(epoch):
        return iter(range(100 * epoch, 100 * epoch + 37))

    def run(dp_size, state, steps):
        taken = [[] for _ in range(dp_size)]
        states = []
        for rank in range(dp_size):
            loader = DataParallelStreamLoader(open_stream, global_batch_size=8, dp_rank=rank, dp_size=dp_size)
            if state:
                loader.load_state_dict(state)
            for count, batch in enumerate(loader, start=1):
                taken[rank].append(batch.tolist())
                if count == steps:
                    break
            states.append(loader.state_dict())
        assert all(other == states[0] for other in states)
        steps_taken = len(taken[0])
        return [x for step in range(steps_taken) for rank in range(dp_size) for x in taken[rank][step]], states[0]

    first, state = run(4, None, 2)
    rest, state = run(2, state, None)
    assert first + rest == list(range(32))
    assert state["epoch"] == 1


def test_config_builds_a_length_bucketed_loader_from_the_dataset_lengths():
    config = DataLoaderConfig.model_validate(
        {"global_batch_size": 8, "order": {"kind": "length_bucketed", "seed": 7}, "epochs": 1}
    )
    loader = build_data_loader(config, Numbers(), dp_rank=0, dp_size=1)
    assert [x for batch in loader for x in batch.tolist()] == ORDERS["length-bucketed"].epoch_order(0)[:96].tolist()
    with pytest.raises(ValueError, match="needs one length per sample"):
        build_data_loader(config, list(range(10)), dp_rank=0, dp_size=1)
