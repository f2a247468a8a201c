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
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, assert_never

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from d9d.core.checkpoint import write_durable
from d9d.core.dist import DistributedContext
from d9d.core.loop import BuiltModel, EventSubscriber, ModelLoader
from d9d.models.blocks.compilation import compile_model
from d9d.models.blocks.late_init import materialize_
from d9d.models.blocks.moe import aux_loss_weights, moe_bias_balancer
from d9d.models.config import DecoderConfig
from d9d.models.qwen3.dense import Qwen3DenseForCausalLM
from d9d.models.qwen3.moe import Qwen3MoeForCausalLM
from d9d.models.qwen3.parallelize import parallelize_qwen3_dense, parallelize_qwen3_moe
from d9d.models.qwen3.params import Qwen3DenseParameters, Qwen3MoeParameters
from d9d.models.qwen3.tensor_parallel import TensorParallelConfig
from d9d.parallel import AnyDataParallelConfig, GradientSync, GradientSyncs
from d9d.parallel.context import ContextParallelConfig
from d9d.pipeline import (
    SINGLE_STAGE,
    PipelineAuxLosses,
    PipelineConfig,
    PipelineStage,
    build_pipeline_schedule,
    pipeline_group,
)

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
    context: ContextParallelConfig | None = None,
    pipeline: PipelineConfig | None = None,
    num_microbatches: int | None = None,
) -> BuiltModel:
    """The model on `ctx`: built on meta, `prepare`d (e.g. PEFT injection, so the plan shards the adapters too),
    parallelised by its family's plan (tensor parallelism with `tensor_parallel` when the mesh has `tp > 1`, context
    parallel attention with `context` at `cp > 1`, experts sharded and dispatched at `ep > 1`, then data
    parallelism), materialised, then filled by `loader` (else its seeded initialisation).

    At `pp > 1` this rank's pipeline stages are built that way, one by one (`pipeline`, default 1F1B, over
    `num_microbatches` micro-batches per step), and the result's `model` is their merged view with global names and
    its `schedule` the pipeline schedule the Trainer (or `Inference`) runs them with. The stages' batches are the
    data-parallel rank's micro-batches, as without pipelining (docs/design/0015).

    Raises:
        ValueError: `pp > 1` without `num_microbatches`, or a pipeline the layers or micro-batches cannot fill.
    """
    builder = _StageBuilder(config, ctx, data_parallel, prepare, tensor_parallel, context)
    if ctx.degrees.pp > 1:
        if num_microbatches is None:
            raise ValueError(f"build_model: pp={ctx.degrees.pp} needs num_microbatches (micro-batches per step)")
        return builder.pipelined(pipeline or PipelineConfig(), num_microbatches, loader)
    model, sync = builder.stage(SINGLE_STAGE)
    if loader is not None:
        loader(model)
    return BuiltModel(
        model=model, gradient_sync=sync, aux_losses=aux_loss_weights(model), subscribers=builder.subscribers(model)
    )


@dataclass(frozen=True)
class _StageBuilder:
    """What every stage of one model is built from."""

    config: Qwen3DenseModelConfig | Qwen3MoeModelConfig
    ctx: DistributedContext
    data_parallel: AnyDataParallelConfig
    prepare: Callable[[nn.Module], object] | None
    tensor_parallel: TensorParallelConfig | None
    context: ContextParallelConfig | None

    def stage(self, stage: PipelineStage) -> tuple[nn.Module, GradientSync]:
        """One stage (the whole model at `SINGLE_STAGE`): meta -> prepare -> the family's plan -> materialised."""
        config, ctx = self.config, self.ctx
        model: nn.Module
        match config:
            case Qwen3DenseModelConfig():
                with torch.device("meta"):
                    model = Qwen3DenseForCausalLM(config.parameters, config=config.decoder, stage=stage)
                parallelize = parallelize_qwen3_dense
            case Qwen3MoeModelConfig():
                with torch.device("meta"):
                    model = Qwen3MoeForCausalLM(config.parameters, config=config.decoder, stage=stage)
                parallelize = parallelize_qwen3_moe
            case _:
                assert_never(config)
        if self.prepare is not None:
            self.prepare(model)
        sync = parallelize(model, ctx, self.data_parallel, tensor_parallel=self.tensor_parallel, context=self.context)
        materialize_(model, ctx.device)
        if config.decoder.compile_model:
            compile_model(model, backend=config.decoder.compile_backend)
        return model, sync

    def subscribers(self, model: nn.Module) -> tuple[EventSubscriber, ...]:
        """The MoE bias balancer (a loop subscriber) when the model has router expert biases."""
        if not isinstance(self.config, Qwen3MoeModelConfig):
            return ()
        balancer = moe_bias_balancer(model, self.config.expert_bias_rate)
        return (balancer,) if balancer is not None else ()

    def pipelined(self, pipeline: PipelineConfig, num_microbatches: int, loader: ModelLoader | None) -> BuiltModel:
        """This rank's stages, their merged view and the pipeline schedule over them."""
        if self.config.decoder.compile_model:
            raise ValueError(
                f"decoder.compile_model=True with pp={self.ctx.degrees.pp}: a pipeline's split backward needs each "
                "layer's autograd graph; use decoder.compile_layers=True (regional compilation) instead"
            )
        syncs: list[GradientSync] = []

        def build_stage(stage: PipelineStage) -> nn.Module:
            module, sync = self.stage(stage)
            syncs.append(sync)
            return module

        schedule = build_pipeline_schedule(
            pipeline,
            self.ctx,
            num_layers=self.config.parameters.num_layers,
            num_microbatches=num_microbatches,
            build_stage=build_stage,
        )
        model = schedule.model
        if loader is not None:
            loader(model)  # the merged view holds this rank's stages under their global names
        # Every pp rank takes part in the logged auxiliary-loss sum, holding MoE layers or not.
        aux = (
            PipelineAuxLosses(aux_loss_weights(model), pipeline_group(self.ctx), self.ctx.device)
            if isinstance(self.config, Qwen3MoeModelConfig)
            else None
        )
        return BuiltModel(
            model=model,
            gradient_sync=GradientSyncs(*syncs),  # each stage was parallelised alone
            aux_losses=aux,
            subscribers=self.subscribers(model),
            schedule=schedule,
        )


def model_kind(parameters: AnyModelParameters) -> ModelKind:
    return "qwen3_moe" if isinstance(parameters, Qwen3MoeParameters) else "qwen3_dense"


def write_parameters(directory: Path, parameters: AnyModelParameters) -> Path:
    """`directory/parameters.json`: the model's kind and its `*Parameters` (what `d9d convert` turns into HF's
    `config.json`), written atomically: a reader sees the whole file or none."""
    path = directory / PARAMETERS_FILE
    record = {"kind": model_kind(parameters), **parameters.model_dump(mode="json")}
    write_durable(path, (json.dumps(record, indent=2) + "\n").encode("utf-8"))
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
