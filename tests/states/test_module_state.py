"""Loading into and saving from a module on one process: names, shapes and dtypes are checked before any data is
read, with messages naming the parameter and where its data would come from."""

import pytest
import torch
from states_testing import module_with, same_bits, write_checkpoint

from d9d.states import StateMismatchError, load_model_state, read_model_state, save_model_state
from d9d.states import mapper as m


@pytest.fixture
def stored(tmp_path):
    generator = torch.Generator().manual_seed(3)
    tensors = {
        "layer.weight": torch.randn(4, 3, generator=generator).bfloat16(),
        "layer.bias": torch.randn(4, generator=generator).bfloat16(),
        "norm.weight": torch.randn(3, generator=generator),
    }
    return write_checkpoint(tmp_path / "ckpt", tensors, files=2), tensors


def _module(shapes):
    return module_with({name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in shapes.items()})


SHAPES = {
    "layer.weight": ((4, 3), torch.bfloat16),
    "layer.bias": ((4,), torch.bfloat16),
    "norm.weight": ((3,), torch.float32),
}


def test_a_checkpoint_loads_into_parameters_and_saves_back_unchanged(stored, tmp_path):
    source, tensors = stored
    module = _module(SHAPES)
    report = load_model_state(source, module)
    assert report.tensors == 3 and report.bytes_read == sum(t.numel() * t.element_size() for t in tensors.values())
    assert all(same_bits(module.get_parameter(name).detach(), tensor) for name, tensor in tensors.items())
    save_model_state(tmp_path / "again", module)
    again = dict(read_model_state(tmp_path / "again", m.Identity(list(tensors))))
    assert all(same_bits(again[name], tensor) for name, tensor in tensors.items())


def test_keys_the_module_lacks_are_unexpected(stored):
    source, _ = stored
    module = _module({k: v for k, v in SHAPES.items() if k != "norm.weight"})
    # By default the module's own names are read: the checkpoint's extra tensor is unexpected...
    with pytest.raises(StateMismatchError, match=r"unexpected tensors: .* has 'norm.weight', which the mapping"):
        load_model_state(source, module)
    # ...and a mapping that produces it names it as a key the module lacks.
    with pytest.raises(StateMismatchError, match=r"unexpected keys: .* produces 'norm.weight'"):
        load_model_state(source, module, m.Identity(list(SHAPES)))
    load_model_state(source, module, allow_unused=True)
    assert module.get_parameter("layer.bias").abs().sum() > 0


def test_keys_the_mapping_does_not_produce_are_missing_unless_not_strict(stored):
    source, _ = stored
    module = _module({**SHAPES, "extra.weight": ((2,), torch.float32)})
    with pytest.raises(StateMismatchError, match=r"missing keys: the module has 'extra.weight'"):
        load_model_state(source, module, m.Identity(list(SHAPES)))
    load_model_state(source, module, m.Identity(list(SHAPES)), strict=False)
    assert module.get_parameter("layer.bias").abs().sum() > 0


def test_shape_and_dtype_mismatches_name_the_parameter_and_the_file(stored):
    source, _ = stored
    module = _module({**SHAPES, "layer.weight": ((3, 4), torch.bfloat16), "norm.weight": ((3,), torch.float16)})
    with pytest.raises(StateMismatchError) as error:
        load_model_state(source, module)
    message = str(error.value)
    assert "'layer.weight': the module has [3, 4] bfloat16, the mapped checkpoint [4, 3] bfloat16" in message
    assert "'norm.weight': the module has [3] float16, the mapped checkpoint [3] float32" in message
    assert "model-0000" in message  # the file the data would come from
    assert module.get_parameter("layer.bias").abs().sum() == 0  # nothing was loaded


def test_a_mapping_fixes_the_mismatch(stored):
    source, tensors = stored
    module = _module({**SHAPES, "layer.weight": ((3, 4), torch.bfloat16), "norm.weight": ((3,), torch.float16)})
    mapping = m.Parallel(
        [m.Transpose("layer.weight", 0, 1), m.Identity("layer.bias"), m.CastDtype("norm.weight", torch.float16)]
    )
    load_model_state(source, module, mapping)
    assert same_bits(module.get_parameter("layer.weight").detach(), tensors["layer.weight"].t().contiguous())
