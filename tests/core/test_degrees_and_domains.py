"""Degrees resolve against the world size, and every domain gets the expected shape and dimension names."""

import pytest
import torch

from d9d.core.dist import MeshDegrees, MeshDomain, plan_domains

# (degrees, world size) -> expected shape of each domain. Dimension names are fixed per domain (checked below).
DOMAIN_TABLE = [
    (dict(), 1, {"regular": (1, 1, 1, 1, 1), "dense": (1, 1, 1, 1), "expert": (1, 1, 1, 1), "batch": (1, 1, 1, 1)}),
    (
        dict(dp_shard=-1),
        8,
        {"regular": (1, 1, 8, 1, 1), "dense": (1, 1, 8, 1), "expert": (1, 8, 1, 1), "batch": (1, 8, 1, 1)},
    ),
    (
        dict(dp_replicate=2, dp_shard=2),
        4,
        {"regular": (1, 2, 2, 1, 1), "dense": (1, 2, 2, 1), "expert": (1, 4, 1, 1), "batch": (1, 4, 1, 1)},
    ),
    (
        dict(dp_shard=2, tp=2),
        4,
        {"regular": (1, 1, 2, 1, 2), "dense": (1, 1, 2, 2), "expert": (1, 2, 1, 2), "batch": (1, 2, 1, 2)},
    ),
    (
        dict(pp=2, dp_shard=2, cp=2),
        8,
        {"regular": (2, 1, 2, 2, 1), "dense": (2, 1, 4, 1), "expert": (2, 4, 1, 1), "batch": (2, 2, 2, 1)},
    ),
    (
        dict(dp_shard=4, ep=4),
        4,
        {"regular": (1, 1, 4, 1, 1), "dense": (1, 1, 4, 1), "expert": (1, 1, 4, 1), "batch": (1, 4, 1, 1)},
    ),
    (
        dict(dp_replicate=2, dp_shard=2, ep=2),
        4,
        {"regular": (1, 2, 2, 1, 1), "dense": (1, 2, 2, 1), "expert": (1, 2, 2, 1), "batch": (1, 4, 1, 1)},
    ),
    (
        dict(dp_shard=2, cp=2, tp=2, ep=4),
        8,
        {"regular": (1, 1, 2, 2, 2), "dense": (1, 1, 4, 2), "expert": (1, 1, 4, 2), "batch": (1, 2, 2, 2)},
    ),
    (
        dict(pp=2, dp_replicate=2, dp_shard=-1, tp=2, ep=2),
        16,
        {"regular": (2, 2, 2, 1, 2), "dense": (2, 2, 2, 2), "expert": (2, 2, 2, 2), "batch": (2, 4, 1, 2)},
    ),
    (
        dict(pp=4, tp=2),
        8,
        {"regular": (4, 1, 1, 1, 2), "dense": (4, 1, 1, 2), "expert": (4, 1, 1, 2), "batch": (4, 1, 1, 2)},
    ),
]

DIM_NAMES = {
    MeshDomain.REGULAR: ("pp", "dp_replicate", "dp_shard", "cp", "tp"),
    MeshDomain.DENSE: ("pp", "dp_replicate", "dp_cp_shard", "tp"),
    MeshDomain.EXPERT: ("pp", "ep_replicate", "ep", "tp"),
    MeshDomain.BATCH: ("pp", "dp", "cp", "tp"),
    MeshDomain.FLAT: ("world",),
}


@pytest.mark.parametrize(("degrees", "world_size", "expected"), DOMAIN_TABLE)
def test_domain_shapes_and_names(degrees, world_size, expected):
    layouts = plan_domains(MeshDegrees(**degrees).resolve(world_size))
    for domain, shape in expected.items():
        layout = layouts[MeshDomain(domain)]
        assert layout.shape == shape, domain
        assert layout.dim_names == DIM_NAMES[layout.domain]
        assert layout.ranks.shape == shape
    assert layouts[MeshDomain.FLAT].shape == (world_size,)


def test_every_domain_holds_every_rank_once():
    layouts = plan_domains(MeshDegrees(pp=2, dp_replicate=2, dp_shard=2, cp=2, tp=2, ep=4).resolve(32))
    for layout in layouts.values():
        assert sorted(layout.ranks.flatten().tolist()) == list(range(32))


def test_tp_neighbours_and_ep_folds_over_data_ranks():
    layouts = plan_domains(MeshDegrees(dp_shard=4, tp=2, ep=2).resolve(8))
    regular, expert = layouts[MeshDomain.REGULAR], layouts[MeshDomain.EXPERT]
    # tensor-parallel groups are neighbouring ranks
    assert regular.ranks[0, 0, 0, 0].tolist() == [0, 1]
    # an expert-parallel group is made of neighbouring data ranks with the same tp coordinate
    assert expert.ranks[0, 0, :, 0].tolist() == [0, 2]
    assert expert.ranks[0, 1, :, 1].tolist() == [5, 7]
    assert expert.coordinate_of(7) == (0, 1, 1, 1)


def test_a_rank_has_the_same_data_coordinate_in_batch_and_regular_domains():
    layouts = plan_domains(MeshDegrees(dp_replicate=2, dp_shard=2, tp=2).resolve(8))
    for rank in range(8):
        _, dpr, dps, _, tp = layouts[MeshDomain.REGULAR].coordinate_of(rank)
        _, dp, _, batch_tp = layouts[MeshDomain.BATCH].coordinate_of(rank)
        assert (dp, batch_tp) == (dpr * 2 + dps, tp)


@pytest.mark.parametrize(
    ("degrees", "world_size", "message"),
    [
        (
            dict(dp_shard=3, tp=2),
            8,
            (
                r"mesh degrees multiply to 6 but the world size is 8 "
                r"\(pp=1, dp_replicate=1, dp_shard=3, cp=1, tp=2, ep=1\); make the product .* equal 8"
            ),
        ),
        (dict(pp=3, dp_shard=-1), 8, r"dp_shard=-1 cannot fill the world size 8: the other degrees multiply to 3"),
        (dict(dp_shard=4, ep=3), 4, r"ep=3 must divide dp_replicate\*dp_shard\*cp = 4 .*valid ep values: 1, 2, 4"),
        (dict(dp_shard=2, tp=4, ep=4), 8, r"ep=4 must divide dp_replicate\*dp_shard\*cp = 2"),
    ],
)
def test_invalid_degrees_name_the_degrees_world_size_and_what_is_valid(degrees, world_size, message):
    with pytest.raises(ValueError, match=message):
        MeshDegrees(**degrees).resolve(world_size)


def test_degrees_reject_unknown_and_non_positive_values():
    with pytest.raises(ValueError, match="dp_shrd"):
        MeshDegrees(dp_shrd=2)
    with pytest.raises(ValueError, match="tp"):
        MeshDegrees(tp=0)


def test_plan_refuses_unresolved_degrees():
    with pytest.raises(ValueError, match="resolved"):
        plan_domains(MeshDegrees(dp_shard=-1))


def test_coordinate_of_unknown_rank_is_an_error():
    layout = plan_domains(MeshDegrees().resolve(1))[MeshDomain.REGULAR]
    with pytest.raises(ValueError, match="rank 3 is not in the regular domain"):
        layout.coordinate_of(3)
    assert torch.equal(layout.ranks, torch.zeros(1, 1, 1, 1, 1, dtype=torch.int64))
