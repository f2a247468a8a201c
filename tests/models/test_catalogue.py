"""The model catalogue: `AnyModelConfig` chosen by `kind`, `build_model`, and `parameters.json` recording the kind."""

import json

import pytest
import torch
from pydantic import TypeAdapter

from d9d.core.dist import DistributedContext, MeshDegrees
from d9d.core.loop import EventBus, ForwardBackwardFinished
from d9d.models.blocks.moe import MoeBiasBalancer
from d9d.models.catalogue import (
    AnyModelConfig,
    Qwen3DenseModelConfig,
    Qwen3MoeModelConfig,
    build_model,
    model_config_for,
    read_parameters,
    write_parameters,
)
from d9d.models.qwen3 import Qwen3DenseForCausalLM, Qwen3DenseParameters, Qwen3MoeForCausalLM, Qwen3MoeParameters
from d9d.parallel import FsdpConfig

DENSE = {
    "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 64,
}  # fmt: skip
MOE = {**DENSE, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
EAGER = {"attention": {"kind": "eager"}, "grouped_mm": {"kind": "eager"}}


def test_the_kind_picks_the_family_and_build_model_builds_it():
    adapter = TypeAdapter(AnyModelConfig)
    dense = adapter.validate_python({"kind": "qwen3_dense", "parameters": DENSE, "decoder": EAGER})
    moe = adapter.validate_python({"kind": "qwen3_moe", "parameters": MOE, "decoder": EAGER})
    assert isinstance(dense, Qwen3DenseModelConfig) and isinstance(moe, Qwen3MoeModelConfig)
    ctx = DistributedContext.build(MeshDegrees(), device="cpu")
    assert isinstance(build_model(dense, ctx, FsdpConfig()).model, Qwen3DenseForCausalLM)
    built = build_model(moe, ctx, FsdpConfig())
    assert isinstance(built.model, Qwen3MoeForCausalLM)
    assert built.subscribers == ()  # softmax routing: no expert bias to balance


def test_a_moe_with_a_router_bias_gets_its_balancer_as_a_loop_subscriber():
    parameters = {**MOE, "router_scoring": "sigmoid", "router_expert_bias": True}
    config = Qwen3MoeModelConfig.model_validate({"parameters": parameters, "decoder": EAGER, "expert_bias_rate": 0.1})
    ctx = DistributedContext.build(MeshDegrees(), device="cpu")
    built = build_model(config, ctx, FsdpConfig())
    (balancer,) = built.subscribers
    assert isinstance(balancer, MoeBiasBalancer)
    events = EventBus()
    balancer.subscribe(events)
    built.model(torch.randint(0, 64, (2, 9)))
    finished = ForwardBackwardFinished(step=1, num_microbatches=1)
    events.emit(finished)
    assert sorted(finished.metrics) == [
        "expert_load_max_over_mean/model.layers.0.mlp",
        "expert_load_max_over_mean/model.layers.1.mlp",
    ]
    assert all(value >= 1.0 for value in finished.metrics.values())
    bias = built.model.get_submodule("model.layers.0.mlp").router.expert_bias
    assert bias.abs().sum() > 0  # the bias moved towards balance


@pytest.mark.parametrize("raw", [DENSE, MOE])
def test_parameters_json_records_the_kind_and_reads_back(tmp_path, raw):
    parameters = (Qwen3MoeParameters if "num_experts" in raw else Qwen3DenseParameters).model_validate(raw)
    assert model_config_for(parameters).kind == ("qwen3_moe" if "num_experts" in raw else "qwen3_dense")
    write_parameters(tmp_path, parameters)
    record = json.loads((tmp_path / "parameters.json").read_text())
    assert record["kind"] == ("qwen3_moe" if "num_experts" in raw else "qwen3_dense")
    assert read_parameters(tmp_path) == parameters and type(read_parameters(tmp_path)) is type(parameters)


def test_a_parameters_json_without_kind_from_before_the_catalogue_still_reads(tmp_path):
    (tmp_path / "parameters.json").write_text(json.dumps(MOE))
    assert isinstance(read_parameters(tmp_path), Qwen3MoeParameters)


def test_an_unknown_kind_is_refused_naming_the_valid_ones(tmp_path):
    (tmp_path / "parameters.json").write_text(json.dumps({**DENSE, "kind": "llama"}))
    with pytest.raises(ValueError, match=r"kind='llama'.*valid: qwen3_dense, qwen3_moe"):
        read_parameters(tmp_path)


def test_compile_model_compiles_the_whole_single_device_model_with_the_eager_losses_and_gradients():
    from d9d.parallel import SingleDeviceConfig

    ctx = DistributedContext.build(MeshDegrees(), device="cpu")
    eager_config = Qwen3DenseModelConfig.model_validate({"parameters": DENSE, "decoder": EAGER})
    compiled_config = Qwen3DenseModelConfig.model_validate(
        {"parameters": DENSE, "decoder": {**EAGER, "compile_model": True, "compile_backend": "aot_eager"}}
    )
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    results = []
    for config in (eager_config, compiled_config):
        torch.manual_seed(0)  # the same initial weights
        model = build_model(config, ctx, SingleDeviceConfig(mixed_precision={"param_dtype": "float32"})).model
        loss = model(ids, labels=ids).losses.sum()
        loss.backward()
        results.append((model, loss.detach(), {name: p.grad for name, p in model.named_parameters()}))
    (eager, eager_loss, eager_grads), (compiled, compiled_loss, compiled_grads) = results
    assert getattr(compiled, "d9d_compiled", False) and not getattr(eager, "d9d_compiled", False)
    # aot_eager runs the same float32 ATen ops, regrouped: equal up to summation order.
    torch.testing.assert_close(compiled_loss, eager_loss, atol=1e-5, rtol=1e-5)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_compile_model_and_compile_layers_together_are_refused_naming_both():
    with pytest.raises(ValueError, match="compile_layers=True and compile_model=True"):
        Qwen3DenseModelConfig.model_validate(
            {"parameters": DENSE, "decoder": {**EAGER, "compile_model": True, "compile_layers": True}}
        )
