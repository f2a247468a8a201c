"""Job checkpoints of the trainable parameters only (fine-tuning adapters): what they hold, and that loading them
restores the trainable part and the optimizer while leaving the frozen rest as loaded from elsewhere; loading a
part of a model's names from a full job checkpoint (a base model into a model with added parameters)."""

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemReader

from d9d.core.checkpoint import JobCheckpointer, ModelAndOptimizer, load_model_weights

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # one process on purpose


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
    model[0].requires_grad_(False)  # the frozen "base"
    return model


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([param for param in model.parameters() if param.requires_grad], lr=0.1)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 6, generator=torch.Generator().manual_seed(0))).square().sum().backward()
    optimizer.step()


def test_trainable_only_checkpoint_holds_and_restores_only_what_trains(tmp_path):
    model = _model(0)
    optimizer = _optimizer(model)
    _train(model, optimizer)
    checkpointer = JobCheckpointer(tmp_path, keep_last=1, rank=0)
    path = checkpointer.save(1, {"app": ModelAndOptimizer(model, optimizer, trainable_only=True)})

    saved = set(FileSystemReader(path).read_metadata().state_dict_metadata)
    assert {name for name in saved if name.startswith("app.model.")} == {"app.model.1.weight", "app.model.1.bias"}
    assert not any(name.startswith(("app.model.0.", "app.optimizer.state.0.")) for name in saved)

    other = _model(1)  # different weights everywhere; its frozen layer stands for a separately loaded base
    other_optimizer = _optimizer(other)
    _train(other, other_optimizer)
    frozen_before = other[0].weight.detach().clone()
    checkpointer.load(path, {"app": ModelAndOptimizer(other, other_optimizer, trainable_only=True)})
    assert torch.equal(other[1].weight, model[1].weight) and torch.equal(other[1].bias, model[1].bias)
    assert torch.equal(other[0].weight, frozen_before)  # untouched: not in the checkpoint
    state, other_state = optimizer.state_dict()["state"], other_optimizer.state_dict()["state"]
    for index in state:
        assert torch.equal(state[index]["exp_avg_sq"], other_state[index]["exp_avg_sq"])


def test_a_full_checkpoint_loads_a_subset_of_names_into_a_model_with_extra_parameters(tmp_path):
    base = _model(0)
    path = JobCheckpointer(tmp_path, keep_last=1, rank=0).save(1, {"app": ModelAndOptimizer(base, _optimizer(base))})
    extended = _model(1)
    extended.add_module("adapter", nn.Linear(3, 3))  # not in the base checkpoint
    adapter_before = extended.adapter.weight.detach().clone()
    load_model_weights(path, extended, names=["0.weight", "0.bias", "1.weight", "1.bias"])
    assert torch.equal(extended[0].weight, base[0].weight) and torch.equal(extended[1].bias, base[1].bias)
    assert torch.equal(extended.adapter.weight, adapter_before)
    with pytest.raises(KeyError, match=r"names \['2.weight'\] are not in the model's state"):
        load_model_weights(path, extended, names=["2.weight"])
