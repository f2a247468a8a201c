"""Parallel plans select modules by name pattern or declared role, so wrappers injected later are still found."""

import pytest
from torch import nn

from d9d.parallel import ByName, ByRole, assign_role, roles_of, select_modules
from d9d.parallel.plan import name_matches


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(4, 4)
        self.mlp = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(4, 10)


class LoraLinear(nn.Module):
    """A wrapper that takes a Linear's place, as an adapter would."""

    def __init__(self, base):
        super().__init__()
        self.base = base
        self.lora_a = nn.Linear(base.in_features, 2, bias=False)


@pytest.mark.parametrize(
    ("pattern", "name", "matches"),
    [
        ("layers.*", "layers.0", True),
        ("layers.*", "layers.0.attn", False),
        ("layers.*.attn", "layers.1.attn", True),
        ("**.attn", "layers.1.attn", True),
        ("**", "", True),
        ("**.mlp.*", "layers.0.mlp.1", True),
        ("layers.[01]", "layers.1", True),
        ("head", "layers.0", False),
        ("", "", True),
    ],
)
def test_name_patterns_match_segment_by_segment(pattern, name, matches):
    assert name_matches(pattern, name) is matches


def test_selected_units_come_children_first():
    model = Model()
    names = [name for name, _ in select_modules(model, [ByName("layers.*"), ByName("**.mlp"), ByName("")])]
    assert names == ["layers.0.mlp", "layers.1.mlp", "layers.0", "layers.1", ""]


def test_a_wrapper_put_in_a_modules_place_is_still_selected_by_name():
    model = Model()
    model.layers[0].attn = LoraLinear(model.layers[0].attn)
    selected = dict(select_modules(model, [ByName("layers.*.attn")]))
    assert isinstance(selected["layers.0.attn"], LoraLinear)
    assert set(selected) == {"layers.0.attn", "layers.1.attn"}


def test_roles_are_declared_on_instances_and_selected():
    model = Model()
    for layer in model.layers:
        assign_role(layer, "block")
    assign_role(model.head, "head", "output")
    assert roles_of(model.head) == {"head", "output"}
    assert roles_of(model.embed) == frozenset()
    assert [name for name, _ in select_modules(model, [ByRole("block")])] == ["layers.0", "layers.1"]
    # A wrapper that copies the roles of what it wraps is selected in its place.
    wrapped = LoraLinear(model.head)
    assign_role(wrapped, *roles_of(model.head))
    model.head = wrapped
    assert [name for name, _ in select_modules(model, [ByRole("head")])] == ["head.base", "head"]
    assert dict(select_modules(model, [ByRole("head")]))["head"] is wrapped
