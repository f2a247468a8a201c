"""`cast_parameters_in_forward`: FSDP's mixed-precision numerics for parameters outside every FSDP unit.

The reference is the same module run on hand-made bfloat16 copies of its parameters, whose gradients are cast back
to float32: FSDP at one rank does exactly that (all-gather in `param_dtype`, reduce in `reduce_dtype` float32), so
outputs and gradients must agree bit for bit (no tolerance: the same ops on the same values).
"""

import pytest
import torch
from torch import nn

from d9d.parallel.compute_dtype import cast_parameters_in_forward


class _Stacked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 6, bias=True)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 6))
        self.register_buffer("offset", torch.zeros(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(x)) * self.scale + self.offset.to(x.dtype)


def _pair() -> tuple[_Stacked, _Stacked]:
    torch.manual_seed(0)
    model = _Stacked()
    twin = _Stacked()
    twin.load_state_dict(model.state_dict())
    return model, twin


def test_forward_and_gradients_match_hand_cast_bfloat16_copies_bit_for_bit():
    model, twin = _pair()
    cast_parameters_in_forward(model, torch.bfloat16)
    x = torch.randn(5, 8).to(torch.bfloat16)
    out = model(x)
    weight, bias, scale = (p.to(torch.bfloat16) for p in (twin.proj.weight, twin.proj.bias, twin.scale))
    expected = torch.tanh(nn.functional.linear(x, weight, bias)) * scale + twin.offset.to(torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, expected)
    out.float().square().sum().backward()
    expected.float().square().sum().backward()
    for (name, param), reference in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert param.grad is not None and param.grad.dtype == torch.float32, name
        assert torch.equal(param.grad, reference.grad), name


def test_parameters_are_back_after_forward_and_after_a_forward_that_raised():
    model, _ = _pair()
    before = dict(model.named_parameters())
    cast_parameters_in_forward(model, torch.bfloat16)
    model(torch.randn(2, 8).to(torch.bfloat16))
    assert dict(model.named_parameters()) == before
    assert all(p.dtype == torch.float32 for p in model.state_dict().values())
    with pytest.raises(RuntimeError):
        model(torch.randn(2, 7).to(torch.bfloat16))  # wrong width: the linear raises inside forward
    assert dict(model.named_parameters()) == before
    assert all(isinstance(p, nn.Parameter) for p in model.parameters())


def test_gradients_accumulate_over_micro_batches_in_the_master_dtype():
    model, twin = _pair()
    cast_parameters_in_forward(model, torch.bfloat16)
    for seed in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
        model(x).float().sum().backward()
        weight, bias, scale = (p.to(torch.bfloat16) for p in (twin.proj.weight, twin.proj.bias, twin.scale))
        (torch.tanh(nn.functional.linear(x, weight, bias)) * scale).float().sum().backward()
    for param, reference in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(param.grad, reference.grad)


def test_no_dtype_or_parameters_already_in_it_install_nothing():
    model, _ = _pair()
    cast_parameters_in_forward(model, None)
    cast_parameters_in_forward(model, torch.float32)
    assert not model._forward_pre_hooks and not model._forward_hooks
