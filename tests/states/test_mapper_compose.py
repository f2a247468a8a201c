"""Compositions: net groups, pass-through, disjointness, prefix scopes, restriction, and plan-time errors that name
the names involved."""

import pytest
import torch

from d9d.states import MappingError, TensorMeta
from d9d.states import mapper as m
from d9d.states.meta import crop, shift


def _g(inputs, outputs):
    return m.StateGroup(frozenset(inputs), frozenset(outputs))


def _t(*shape):
    return torch.arange(int(torch.tensor(shape).prod())).reshape(shape).float()


def test_sequential_passes_untouched_names_through_and_reports_net_groups():
    mapper = m.Sequential(
        [
            m.Rename({"a": "b"}),
            m.Stack(["b", "c"], "s"),  # `c` is not produced by stage 0: it passes through it
            m.Transpose("s", 0, 1),
            m.Identity("x"),  # `x` passes through stages 0-2
        ]
    )
    assert mapper.state_dependency_groups() == {_g({"a", "c"}, {"s"}), _g({"x"}, {"x"})}
    a, c, x = _t(2, 3), _t(2, 3) + 100, _t(4)
    out = mapper.apply({"a": a, "c": c})
    assert torch.equal(out["s"], torch.stack([a, c]).transpose(0, 1))
    assert mapper.apply({"x": x})["x"] is x


def test_sequential_merges_stage_groups_that_share_a_tensor():
    # Stage 0 makes two tensors from one; stage 1 fuses one of them with another input: one net group results.
    mapper = m.Sequential([m.Chunk("ab", ["a", "b"]), m.Concatenate(["b", "c"], "bc")])
    assert mapper.state_dependency_groups() == {_g({"ab", "c"}, {"a", "bc"})}


def test_sequential_names_a_pass_through_that_collides_with_a_stage_output():
    with pytest.raises(MappingError, match=r"'y' \(an output\) is written by two groups"):
        m.Sequential([m.Rename({"a": "y"}), m.Rename({"b": "y"})])


def test_sequential_names_a_tensor_read_twice():
    # Stage 1 needs `a` as it was, but stage 0 consumes `a`: the pass-through and stage 0 both read it.
    with pytest.raises(MappingError, match=r"'a' \(an input\) is read by two groups"):
        m.Sequential([m.Rename({"a": "b"}), m.Concatenate(["a", "b"], "ab")])


def test_parallel_is_a_disjoint_union_and_names_overlaps():
    mapper = m.Parallel([m.Rename({"a": "x"}), m.Identity("b")])
    assert mapper.state_dependency_groups() == {_g({"a"}, {"x"}), _g({"b"}, {"b"})}
    with pytest.raises(MappingError, match=r"'x' is written by two groups.*child 0.*child 1"):
        m.Parallel([m.Rename({"a": "x"}), m.Rename({"b": "x"})])
    with pytest.raises(MappingError, match="'a' is read by two groups"):
        m.Parallel([m.Rename({"a": "x"}), m.Rename({"a": "y"})])


def test_graph_wires_by_name_in_any_order_and_rejects_cycles():
    graph = m.Graph([m.Concatenate(["g", "u"], "gu", dim=1), m.Stack(["g0", "g1"], "g"), m.Stack(["u0", "u1"], "u")])
    assert graph.state_dependency_groups() == {_g({"g0", "g1", "u0", "u1"}, {"gu"})}
    parts = {name: _t(2, 2) + i for i, name in enumerate(["g0", "g1", "u0", "u1"])}
    expected = torch.cat([torch.stack([parts["g0"], parts["g1"]]), torch.stack([parts["u0"], parts["u1"]])], dim=1)
    assert torch.equal(graph.apply(parts)["gu"], expected)
    with pytest.raises(MappingError, match=r"cycle through .*'x'.*'y'|cycle through .*'y'.*'x'"):
        m.Graph([m.Rename({"x": "y"}), m.Rename({"y": "x"})])
    with pytest.raises(MappingError, match="'z' is written by two groups"):
        m.Graph([m.Rename({"x": "z"}), m.Rename({"y": "z"})])


def test_prefix_scope_runs_one_mapper_under_many_prefixes():
    layer = m.Concatenate(["q", "k"], "qk")
    mapper = m.PrefixScope(layer, ["layers.0.", "layers.1."])
    assert mapper.state_dependency_groups() == {
        _g({"layers.0.q", "layers.0.k"}, {"layers.0.qk"}),
        _g({"layers.1.q", "layers.1.k"}, {"layers.1.qk"}),
    }
    out = mapper.apply({"layers.1.q": _t(2, 2), "layers.1.k": _t(1, 2)})
    assert list(out) == ["layers.1.qk"] and out["layers.1.qk"].shape == (3, 2)
    with pytest.raises(MappingError, match="listed more than once"):
        m.PrefixScope(layer, ["a.", "a."])


def test_restrict_groups_keeps_a_subset_and_rejects_foreign_groups():
    mapper = m.Rename({"a": "x", "b": "y"})
    only = m.RestrictGroups(mapper, [_g({"a"}, {"x"})])
    assert only.state_dependency_groups() == {_g({"a"}, {"x"})}
    with pytest.raises(MappingError, match="no group reads exactly"):
        only.apply({"b": _t(1)})
    with pytest.raises(MappingError, match="not groups of"):
        m.RestrictGroups(mapper, [_g({"c"}, {"z"})])


def test_region_plans_compose_through_sequential_prefix_and_parallel():
    experts = [f"e{i}" for i in range(4)]
    mapper = m.PrefixScope(
        m.Parallel(
            [
                m.Sequential([m.Stack(experts, "w"), m.Transpose("w", 1, 2), m.CastDtype("w", torch.float64)]),
                m.Identity("bias"),
            ]
        ),
        "l.",
    )
    inputs = {f"l.{e}": _t(3, 5) + i for i, e in enumerate(experts)}
    metas = {n: TensorMeta.of(t) for n, t in inputs.items()}
    full = mapper.apply(dict(inputs))["l.w"]
    wanted = {"l.w": ((1, 3), (2, 5), (0, 2))}  # experts 1-2, some rows of the transposed weight
    plan = mapper.plan_regions(metas, wanted)
    assert set(plan.reads) == {"l.e1", "l.e2"}
    assert all(box == ((0, 2), (2, 5)) for box in plan.reads.values())
    assert plan.copies is None  # a transpose reorders elements: the plan must run, not just copy
    out = plan.run({n: crop(inputs[n], box) for n, box in plan.reads.items()})
    assert torch.equal(out["l.w"], crop(full, wanted["l.w"]))


def test_copies_chain_through_stages_so_fused_outputs_assemble_in_place():
    # gate/up experts stacked, then concatenated side by side: each expert lands in one slab of the output.
    gate, up = [f"g{i}" for i in range(3)], [f"u{i}" for i in range(3)]
    mapper = m.PrefixScope(
        m.Sequential([m.Parallel([m.Stack(gate, "g"), m.Stack(up, "u")]), m.Concatenate(["g", "u"], "gu", dim=1)]),
        "l.",
    )
    inputs = {f"l.{name}": _t(2, 4) + i for i, name in enumerate(gate + up)}
    metas = {n: TensorMeta.of(t) for n, t in inputs.items()}
    full = mapper.apply(dict(inputs))["l.gu"]
    for wanted in [((0, 3), (0, 4), (0, 4)), ((1, 2), (1, 3), (0, 4)), ((0, 3), (0, 4), (2, 3))]:
        plan = mapper.plan_regions(metas, {"l.gu": wanted})
        assert plan.copies is not None
        out = torch.full([b - a for a, b in wanted], float("nan"))
        for copy in plan.copies:
            assert copy.target == "l.gu" and copy.source in plan.reads
            target = crop(out, shift(copy.target_box, wanted))
            target.copy_(crop(inputs[copy.source], copy.source_box).reshape(target.shape))
        assert torch.equal(out, crop(full, wanted))
    whole = mapper.plan_regions(metas, {"l.gu": ((0, 3), (0, 4), (0, 4))})
    assert {(c.source, c.target_box) for c in whole.copies} >= {("l.g1", ((1, 2), (0, 2), (0, 4)))}


def test_a_mapper_that_returns_other_names_than_it_declares_is_caught():
    class Liar(m.OpMapper):
        def __init__(self):
            super().__init__([m.leaf.rename.RenameOp("a", "b")])

        def apply(self, group):
            return {"c": group["a"]}

    with pytest.raises(MappingError, match="must return exactly the outputs it declares"):
        m.Sequential([Liar(), m.Identity("b")]).apply({"a": _t(1)})
