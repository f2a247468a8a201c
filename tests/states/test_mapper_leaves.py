"""Leaf mappers: what they compute, the shapes they infer, and that a region plan gives exactly a crop of the full
result while reading only what it needs."""

import random

import pytest
import torch

from d9d.states import MappingError, TensorMeta
from d9d.states import mapper as m
from d9d.states.meta import Box, box_numel, box_shape, crop, shift

GEN = torch.Generator().manual_seed(0)


def _tensor(*shape, dtype=torch.float32):
    return torch.randn(shape, generator=GEN).to(dtype)


def _random_box(shape, rng):
    box = []
    for size in shape:
        start = rng.randrange(size + 1)
        stop = rng.randrange(start, size + 1)
        box.append((start, stop))
    return tuple(box)


def _check_regions(mapper, inputs, *, trials=40, seed=0):
    """For random wanted boxes, running the region plan on crops of the inputs equals cropping the full result."""
    rng = random.Random(seed)
    metas = {name: TensorMeta.of(t) for name, t in inputs.items()}
    full = mapper.apply(dict(inputs))
    inferred = mapper.infer(metas)
    assert {n: TensorMeta.of(t) for n, t in full.items()} == inferred
    read_elements = []
    copies_seen: list[bool] = []
    for _ in range(trials):
        wanted = {name: _random_box(meta.shape, rng) for name, meta in inferred.items()}
        plan = mapper.plan_regions(metas, wanted)
        assert set(plan.reads) <= set(inputs)
        regions = {name: crop(inputs[name], box).clone() for name, box in plan.reads.items()}
        produced = plan.run(regions)
        assert produced.keys() == wanted.keys()
        for name, box in wanted.items():
            assert torch.equal(produced[name], crop(full[name], box)), (name, box)
        if plan.copies is not None:
            # An empty wanted region needs no data, so any mapper may describe it as (zero) copies.
            if any(box_numel(box) for box in wanted.values()):
                copies_seen.append(True)
            assembled = assemble(plan.copies, inputs, wanted, inferred)
            for name, box in wanted.items():
                assert torch.equal(assembled[name], crop(full[name], box)), (name, box)
        read_elements.append(
            (sum(box_numel(b) for b in plan.reads.values()), sum(box_numel(b) for b in wanted.values()))
        )
    # A mapper either describes every non-empty region as copies or none of them.
    assert len(copies_seen) in (0, len([r for r in read_elements if r[1] > 0]))
    return read_elements, bool(copies_seen)


def assemble(copies, inputs, wanted, metas):
    """Build the wanted outputs from copies alone, as the reader does: the copies must describe them fully."""
    outputs = {name: torch.full(box_shape(box), float("nan"), dtype=metas[name].dtype) for name, box in wanted.items()}
    for copy in copies:
        target = crop(outputs[copy.target], shift(copy.target_box, wanted[copy.target]))
        target.copy_(crop(inputs[copy.source], copy.source_box).reshape(target.shape))
    return outputs


def test_rename_identity_and_select_child_move_tensors_without_copying():
    a, b = _tensor(2, 3), _tensor(4)
    assert m.Rename({"a": "x", "b": "y"}).apply({"a": a}) == {"x": a}
    assert m.Identity(["a", "b"]).apply({"b": b})["b"] is b
    assert set(m.SelectChildModules("model", ["w"]).apply({"model.w": a})) == {"w"}
    groups = m.Rename({"a": "x", "b": "y"}).state_dependency_groups()
    assert groups == {
        m.StateGroup(frozenset({"a"}), frozenset({"x"})),
        m.StateGroup(frozenset({"b"}), frozenset({"y"})),
    }
    assert m.Drop("a").apply({"a": a}) == {}


@pytest.mark.parametrize(
    ("mapper", "inputs", "moves_only"),
    [
        (m.Rename({"a": "b"}), {"a": _tensor(6, 5)}, True),
        (m.CastDtype("a", torch.bfloat16), {"a": _tensor(6, 5)}, False),
        (m.CastDtype("a", torch.float32), {"a": _tensor(6, 5)}, True),  # already float32: nothing to convert
        (m.Transpose("a", 0, 2), {"a": _tensor(3, 4, 5)}, False),
        (m.Transpose("a", -1, -2), {"a": _tensor(3, 4, 5)}, False),
        (m.Squeeze("a", 1), {"a": _tensor(3, 1, 5)}, True),
        (m.Unsqueeze("a", -1), {"a": _tensor(3, 5)}, True),
    ],
    ids=["rename", "cast", "cast-same", "transpose", "transpose-negative", "squeeze", "unsqueeze"],
)
def test_elementwise_leaves_read_exactly_the_wanted_elements(mapper, inputs, moves_only):
    reads, copies = _check_regions(mapper, inputs)
    assert all(read == wanted for read, wanted in reads)
    assert copies == moves_only


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_stack_reads_only_the_stacked_inputs_inside_the_wanted_range(dim):
    inputs = {f"e{i}": _tensor(4, 6) for i in range(8)}
    mapper = m.Stack(list(inputs), "stacked", dim=dim)
    assert mapper.apply(inputs)["stacked"].shape[dim] == 8
    reads, copies = _check_regions(mapper, inputs)
    assert all(read == wanted for read, wanted in reads) and copies


def test_an_expert_parallel_rank_reads_only_its_experts():
    inputs = {f"e{i}": TensorMeta((4, 6), torch.bfloat16) for i in range(8)}
    plan = m.Stack(list(inputs), "stacked").plan_regions(inputs, {"stacked": ((2, 4), (0, 4), (0, 6))})
    assert plan.reads == {"e2": ((0, 4), (0, 6)), "e3": ((0, 4), (0, 6))}


def test_unstack_and_chunk_read_a_bounding_region():
    for mapper, inputs in [
        (m.Unstack("a", ["x", "y", "z"], dim=1), {"a": _tensor(4, 3, 5)}),
        (m.Chunk("a", ["q", "k", "v"], dim=0, sizes=[4, 2, 2]), {"a": _tensor(8, 6)}),
        (m.Chunk("a", ["x", "y"], dim=-1), {"a": _tensor(3, 8)}),
    ]:
        _, copies = _check_regions(mapper, inputs)
        assert copies


@pytest.mark.parametrize("dim", [0, 1])
def test_concatenate_reads_only_the_matching_parts_of_each_input(dim):
    inputs = (
        {"q": _tensor(8, 6), "k": _tensor(2, 6), "v": _tensor(2, 6)}
        if dim == 0
        else {"q": _tensor(6, 8), "k": _tensor(6, 2), "v": _tensor(6, 2)}
    )
    reads, copies = _check_regions(m.Concatenate(list(inputs), "qkv", dim=dim), inputs)
    assert all(read == wanted for read, wanted in reads) and copies


def test_inverse_pairs_round_trip_bit_exactly():
    a = _tensor(4, 3, 5, dtype=torch.bfloat16)
    parts = m.Unstack("a", ["x", "y", "z"], dim=1).apply({"a": a})
    assert torch.equal(m.Stack(["x", "y", "z"], "a", dim=1).apply(parts)["a"], a)
    chunks = m.Chunk("a", ["p", "q"], dim=2, sizes=[2, 3]).apply({"a": a})
    assert torch.equal(m.Concatenate(["p", "q"], "a", dim=2).apply(chunks)["a"], a)


@pytest.mark.parametrize(
    ("build", "metas", "message"),
    [
        (
            lambda: m.Stack(["a", "b"], "s"),
            {"a": ((2, 3), torch.float32), "b": ((2, 4), torch.float32)},
            r"'b' is \[2, 4\]",
        ),
        (
            lambda: m.Concatenate(["a", "b"], "c", dim=0),
            {"a": ((2, 3), torch.float32), "b": ((2, 4), torch.float32)},
            "all dimensions but 0",
        ),
        (lambda: m.Concatenate(["a", "b"], "c"), {"a": ((2,), torch.float32), "b": ((2,), torch.float16)}, "the dtype"),
        (lambda: m.Chunk("a", ["x", "y"]), {"a": ((5,), torch.float32)}, "not divisible into 2"),
        (lambda: m.Chunk("a", ["x", "y"], sizes=[2, 2]), {"a": ((5,), torch.float32)}, "do not add up"),
        (lambda: m.Squeeze("a", 0), {"a": ((2, 1), torch.float32)}, "has size 2, not 1"),
        (lambda: m.Unstack("a", ["x"]), {"a": ((2, 1), torch.float32)}, "2 but 1 outputs"),
    ],
    ids=["stack-shapes", "concat-shapes", "concat-dtypes", "chunk-equal", "chunk-sizes", "squeeze", "unstack"],
)
def test_shape_inference_rejects_what_cannot_fit_naming_the_tensors(build, metas, message):
    mapper = build()
    with pytest.raises(MappingError, match=message):
        mapper.infer({name: TensorMeta(shape, dtype) for name, (shape, dtype) in metas.items()})


def test_a_leaf_rejects_duplicate_and_colliding_names():
    with pytest.raises(MappingError, match="listed more than once"):
        m.Identity(["a", "a"])
    with pytest.raises(MappingError, match="Rename targets: 'x' listed more than once"):
        m.Rename({"a": "x", "b": "x"})
    with pytest.raises(MappingError, match="no group reads exactly"):
        m.Rename({"a": "x"}).apply({"b": _tensor(1)})


def test_boxes_are_half_open_ranges_per_dimension():
    box: Box = ((1, 3), (0, 2))
    assert crop(torch.arange(12).reshape(4, 3), box).tolist() == [[3, 4], [6, 7]]
