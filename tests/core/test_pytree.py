"""Nested batches: flatten, map, split into micro-batches and join back."""

from dataclasses import dataclass

import pytest
import torch

from d9d.core.pytree import (
    join_microbatches,
    split_microbatches,
    tree_flatten,
    tree_leaves,
    tree_map_tensors,
    tree_unflatten,
)


@dataclass
class Batch:
    tokens: torch.Tensor
    extra: dict


def _batch() -> dict:
    return {
        "input_ids": torch.arange(24).reshape(8, 3),
        "labels": (torch.arange(8), torch.ones(8, 2)),
        "meta": {"name": "corpus", "step": 7},
        "record": Batch(tokens=torch.arange(16).reshape(8, 2), extra={"mask": torch.ones(8, dtype=torch.bool)}),
    }


def test_flatten_and_unflatten_round_trip_including_dataclasses():
    batch = _batch()
    leaves, spec = tree_flatten(batch)
    assert len(leaves) == 7
    rebuilt = tree_unflatten(leaves, spec)
    assert isinstance(rebuilt["record"], Batch)
    assert torch.equal(rebuilt["record"].tokens, batch["record"].tokens)


def test_map_tensors_keeps_other_leaves():
    doubled = tree_map_tensors(lambda t: t * 2, _batch())
    assert doubled["meta"] == {"name": "corpus", "step": 7}
    assert torch.equal(doubled["labels"][0], torch.arange(8) * 2)


@pytest.mark.parametrize("num_microbatches", [1, 2, 4, 8])
def test_split_then_join_is_the_identity(num_microbatches):
    batch = _batch()
    micro = split_microbatches(batch, num_microbatches)
    assert len(micro) == num_microbatches
    assert micro[0]["input_ids"].shape == (8 // num_microbatches, 3)
    assert micro[-1]["meta"] == batch["meta"]
    joined = join_microbatches(micro)
    for original, restored in zip(tree_leaves(batch), tree_leaves(joined), strict=True):
        if isinstance(original, torch.Tensor):
            assert torch.equal(original, restored)
        else:
            assert original == restored


def test_split_along_another_dimension():
    micro = split_microbatches({"x": torch.zeros(2, 6)}, 3, dim=1)
    assert [m["x"].shape for m in micro] == [torch.Size([2, 2])] * 3
    assert join_microbatches(micro, dim=1)["x"].shape == (2, 6)


def test_split_names_the_leaf_that_cannot_be_divided():
    with pytest.raises(ValueError, match=r"batch leaf \['labels'\]\[1\] with shape \[6, 2\] cannot be split into 4"):
        split_microbatches({"input_ids": torch.zeros(8), "labels": (torch.zeros(8), torch.zeros(6, 2))}, 4)


def test_join_rejects_differing_structures_and_values():
    with pytest.raises(ValueError, match="different structure"):
        join_microbatches([{"a": torch.zeros(1)}, {"b": torch.zeros(1)}])
    with pytest.raises(ValueError, match=r"non-tensor leaf \['step'\] differs"):
        join_microbatches([{"x": torch.zeros(1), "step": 1}, {"x": torch.zeros(1), "step": 2}])
