"""The model catalogue: which models d9d builds, chosen by `kind`, and the `parameters.json` that names one.

`AnyModelConfig` is the discriminated model section of a job (`kind: qwen3_dense | qwen3_moe`, the family's
`*Parameters`, the `DecoderConfig`); `build_model` turns it into a core `BuiltModel` (meta device -> `prepare`, e.g.
PEFT injection -> the family's parallel plan -> materialise -> optional load), with the MoE bias balancer
subscribed to the loop when the model has one. `write_parameters` / `read_parameters` store a model directory's
shape as `{"kind": ..., **parameters}`, so every model directory d9d writes says what it holds.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal, assert_never

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from d9d.core.dist import DistributedContext
from d9d.core.loop import BuiltModel, EventSubscriber, ModelLoader
from d9d.models.blocks.late_init import materialize_
from d9d.models.blocks.moe import aux_loss_weights, moe_bias_balancer
from d9d.models.config import DecoderConfig
from d9d.models.qwen3.dense import Qwen3DenseForCausalLM
from d9d.models.qwen3.moe import Qwen3MoeForCausalLM
from d9d.models.qwen3.parallelize import parallelize_qwen3_dense, parallelize_qwen3_moe
from d9d.models.qwen3.params import Qwen3DenseParameters, Qwen3MoeParameters
from d9d.models.qwen3.tensor_parallel import TensorParallelConfig
from d9d.parallel import AnyDataParallelConfig

PARAMETERS_FILE = "parameters.json"
ModelKind = Literal["qwen3_dense", "qwen3_moe"]
AnyModelParameters = Qwen3DenseParameters | Qwen3MoeParameters


class Qwen3DenseModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["qwen3_dense"] = "qwen3_dense"
    parameters: Qwen3DenseParameters
    decoder: DecoderConfig = Field(default_factory=DecoderConfig)


class Qwen3MoeModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["qwen3_moe"] = "qwen3_moe"
    parameters: Qwen3MoeParameters
    decoder: DecoderConfig = Field(default_factory=DecoderConfig)
    expert_bias_rate: float = Field(default=1e-3, ge=0, description="aux-loss-free balancing step (router_expert_bias)")


AnyModelConfig = Annotated[Qwen3DenseModelConfig | Qwen3MoeModelConfig, Field(discriminator="kind")]


def build_model(
    config: Qwen3DenseModelConfig | Qwen3MoeModelConfig,
    ctx: DistributedContext,
    data_parallel: AnyDataParallelConfig,
    *,
    prepare: Callable[[nn.Module], object] | None = None,
    loader: ModelLoader | None = None,
    tensor_parallel: TensorParallelConfig | None = None,
) -> BuiltModel:
    """The model on `ctx`: built on meta, `prepare`d (e.g. PEFT injection, so the plan shards the adapters too),
    parallelised by its family's plan (with `tensor_parallel` when the mesh has `tp > 1`), materialised, then filled
    by `loader` (else its seeded initialisation)."""
    model: nn.Module
    subscribers: tuple[EventSubscriber, ...] = ()
    match config:
        case Qwen3DenseModelConfig():
            with torch.device("meta"):
                model = Qwen3DenseForCausalLM(config.parameters, config=config.decoder)
            if prepare is not None:
                prepare(model)
            sync = parallelize_qwen3_dense(model, ctx, data_parallel, tensor_parallel=tensor_parallel)
        case Qwen3MoeModelConfig():
            with torch.device("meta"):
                model = Qwen3MoeForCausalLM(config.parameters, config=config.decoder)
            if prepare is not None:
                prepare(model)
            sync = parallelize_qwen3_moe(model, ctx, data_parallel, tensor_parallel=tensor_parallel)
            balancer = moe_bias_balancer(model, config.expert_bias_rate)
            subscribers = (balancer,) if balancer is not None else ()
        case _:
            assert_never(config)
    materialize_(model, ctx.device)
    if loader is not None:
        loader(model)
    return BuiltModel(model=model, gradient_sync=sync, aux_losses=aux_loss_weights(model), subscribers=subscribers)


def model_kind(parameters: AnyModelParameters) -> ModelKind:
    return "qwen3_moe" if isinstance(parameters, Qwen3MoeParameters) else "qwen3_dense"


def write_parameters(directory: Path, parameters: AnyModelParameters) -> Path:
    """`directory/parameters.json`: the model's kind and its `*Parameters` (what `d9d convert` turns into HF's
    `config.json`)."""
    path = directory / PARAMETERS_FILE
    record = {"kind": model_kind(parameters), **parameters.model_dump(mode="json")}
    path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return path


def read_parameters(directory: Path) -> AnyModelParameters:
    """The parameters in `directory/parameters.json`. A file written before it recorded `kind` is read by the
    presence of `num_experts` (the one place that guess remains, for model directories written by d9d 0.1 betas)."""
    path = directory / PARAMETERS_FILE
    raw: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    kind = raw.pop("kind", "qwen3_moe" if "num_experts" in raw else "qwen3_dense")
    match kind:
        case "qwen3_dense":
            return Qwen3DenseParameters.model_validate(raw)
        case "qwen3_moe":
            return Qwen3MoeParameters.model_validate(raw)
        case _:
            raise ValueError(f"{path}: kind={kind!r} is not a model d9d knows; valid: qwen3_dense, qwen3_moe")


def model_config_for(parameters: AnyModelParameters, decoder: DecoderConfig | None = None) -> AnyModelConfig:
    """The model section that builds a model of `parameters` (e.g. read from a checkpoint's `parameters.json`)."""
    decoder = decoder or DecoderConfig()
    if isinstance(parameters, Qwen3MoeParameters):
        return Qwen3MoeModelConfig(parameters=parameters, decoder=decoder)
    return Qwen3DenseModelConfig(parameters=parameters, decoder=decoder)


def __getattr__(name: str) -> Any:
    # Before 0009 this module held the named conversions; they live in `d9d.models.conversions` now.
    if name in ("NAMED_MAPPINGS", "named_mapping", "describe_mappings", "NamedMapping"):
        from d9d.models import conversions

        return getattr(conversions, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
