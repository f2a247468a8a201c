"""The fine-tune rank program: `torchrun --nproc-per-node N -m d9d.flows.jobs.finetune.program --config ft.yaml`.

Every rank runs the same wiring as pretrain (the catalogue's `build_model`, packed data, the task), with a PEFT
method injected into the meta-device model (each pipeline stage's at `degrees.pp > 1`) before the parallel plan (so
FSDP shards the adapters too), the adapters drawn from the stage's seed and their names (the same at any layout),
the base weights loaded from a job checkpoint or safetensors (d9d layout, or through `stage.base_mapping`, e.g.
straight from a Hugging Face directory), and an optimizer over the trainable parameters only. The `Trainer` resumes from
`checkpoints` (adapter-only job checkpoints; the base is loaded first). At the end it writes into `output`:

- `adapter/`: the trained parameters alone (d9d-layout safetensors), with `peft.json` (the method) beside it;
- `merged/`: the adapters folded into the base weights (d9d-layout safetensors, the base model's names) with its
  `parameters.json`, so `d9d convert --mapping qwen3-d9d-to-hf merged/ DIR` gives a `transformers` directory;
- `hf_peft/` (with `export_hf_peft`): `adapter_model.safetensors` + `adapter_config.json` for HF `peft`;
- `finetune.json`: validation loss before and after, parameter counts.

Pipelined, training runs through the pipeline schedule, the validation loss through its forward-only program, and
every export gathers the stages' tensors onto pipeline rank 0 (`d9d.flows.jobs.weights.save_state_directory`).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import assert_never

import torch
import torch.distributed as dist
from torch import nn

from d9d.core.config import load_config
from d9d.core.data.loader_config import SequentialOrderConfig
from d9d.core.dist import DistributedContext
from d9d.core.loop import BuiltModel, EventBus, ModelLoader, TrainResult, evaluate
from d9d.core.loop.reduce import token_group
from d9d.flows.jobs.finetune.base import load_base, resolve_base
from d9d.flows.jobs.finetune.config import FinetuneRankConfig
from d9d.flows.jobs.rank_wiring import (
    PackedCausalLMTask,
    build_rank_model,
    build_stage_trainer,
    data_parallel_size,
    packed_loader,
    packed_source,
    packed_task,
    training_rank_main,
)
from d9d.flows.jobs.weights import save_model_directory, save_state_directory
from d9d.metrics.trackers import build_tracker
from d9d.models.blocks.late_init import AdapterLateInit
from d9d.models.catalogue import (
    AnyModelConfig,
    Qwen3DenseModelConfig,
    Qwen3MoeModelConfig,
)
from d9d.models.qwen3 import mapper_to_huggingface_qwen3_dense, mapper_to_huggingface_qwen3_moe
from d9d.peft import PeftInjectionResult, PeftMethod, build_peft_method, inject_peft_and_freeze, merge_peft
from d9d.peft.export import export_hf_peft_adapter
from d9d.pipeline import pipeline_group
from d9d.states.mapper import ModelStateMapper

REPORT_FILE = "finetune.json"
MERGED_DIR = "merged"
ADAPTER_DIR = "adapter"
PEFT_FILE = "peft.json"


@dataclass(frozen=True, kw_only=True)
class FinetuneResult:
    train: TrainResult
    base: Path
    validation_loss_before: float | None  # the base model's (fresh adapters change nothing)
    validation_loss_after: float | None
    trainable_parameters: int
    total_parameters: int


def validation_loss(
    config: FinetuneRankConfig, ctx: DistributedContext, built: BuiltModel, task: PackedCausalLMTask
) -> float | None:
    """Token-weighted loss over the first `validation_steps` batches of the validation shards (None: none set),
    one micro-batch per step (pipelined: the schedule's forward-only program)."""
    if config.validation_shards is None:
        return None
    loader = packed_loader(
        ctx,
        config.validation_shards,
        seq_len=config.seq_len,
        global_batch_rows=config.stage.validation_rows_per_step,
        order=SequentialOrderConfig(),
        epochs=None,
    )
    data = packed_source(ctx, loader, 1)
    steps = config.stage.validation_steps
    return evaluate(
        built.model, task, data, steps=steps, group=token_group(ctx), device=ctx.device, schedule=built.schedule
    ).loss


def to_hf_mapper(model: AnyModelConfig) -> ModelStateMapper:
    match model:
        case Qwen3DenseModelConfig():
            return mapper_to_huggingface_qwen3_dense(model.parameters)
        case Qwen3MoeModelConfig():
            return mapper_to_huggingface_qwen3_moe(model.parameters)
        case _:
            assert_never(model)


def export_outputs(
    config: FinetuneRankConfig,
    ctx: DistributedContext,
    model: nn.Module,
    method: PeftMethod,
    injection: PeftInjectionResult,
) -> None:
    """Adapters first (they are gone once merged), then the merged model; every rank takes part. At `pp > 1`
    `model` holds this rank's stages: each export gathers every stage's tensors (`save_state_directory`)."""
    output = config.output
    output.mkdir(parents=True, exist_ok=True)
    trainable = {name: param.detach() for name, param in model.named_parameters() if param.requires_grad}
    save_state_directory(output / ADAPTER_DIR, trainable, ctx)  # what `load_trainable_state` reads
    if config.stage.export_hf_peft:
        hf_peft = output / "hf_peft"
        to_hf = to_hf_mapper(config.model)
        export_hf_peft_adapter(model, to_hf, hf_peft, write=ctx.is_main_process, group=pipeline_group(ctx))
    merge_peft(method, model)
    merged = {name: value for name, value in model.state_dict().items() if name not in injection.adapter_names}
    save_model_directory(output / MERGED_DIR, merged, config.model.parameters, ctx)
    if ctx.is_main_process:
        (output / PEFT_FILE).write_text(config.stage.peft.model_dump_json(indent=2) + "\n", encoding="utf-8")


def rank_injection(model: nn.Module, injections: Sequence[PeftInjectionResult]) -> PeftInjectionResult:
    """What the injections into this rank's stages (one each; at `pp = 1` the whole model) changed in `model`, their
    merged view."""
    train = set().union(*(injection.parameters_to_train for injection in injections))
    adapters = set().union(*(injection.adapter_names for injection in injections))
    return PeftInjectionResult.of(model, train=train, adapters=adapters)


def reset_adapters(model: nn.Module, seed: int, device: torch.device) -> None:
    """Draw every adapter of `model` anew from `seed` and its module's name (global: the same in a pipeline stage
    as in the whole model), so a fine-tune starts from the same adapters at any `pp` and data-parallel layout.

    `materialize_` draws them from the global RNG stage by stage, and a pipeline stage starts from the seed on its
    own rank, so the draws would follow the layout (the base weights are loaded, the adapters are not). The global
    RNG is left as it was."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for name, module in model.named_modules():
            if isinstance(module, AdapterLateInit):
                torch.manual_seed(seed + zlib.crc32(name.encode()))
                module.reset_adapter_parameters()


def parameter_counts(model: nn.Module, ctx: DistributedContext) -> tuple[int, int]:
    """(trainable, total) parameters of the whole model: at `pp > 1` summed over the pipeline stages."""
    params = list(model.parameters())
    counts = torch.tensor(
        [sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)],
        dtype=torch.int64,
        device=ctx.device,
    )
    group = pipeline_group(ctx)
    if group is not None:
        dist.all_reduce(counts, group=group)
    trainable, total = counts.tolist()
    return int(trainable), int(total)


def run_finetune(config: FinetuneRankConfig, ctx: DistributedContext, events: EventBus | None = None) -> FinetuneResult:
    """Fine-tune on this rank (every rank of the job calls it with the same config)."""
    stage = config.stage
    method = build_peft_method(stage.peft)
    base = resolve_base(config.base)
    injections: list[PeftInjectionResult] = []  # one per stage module this rank builds

    def prepare(model: nn.Module) -> None:
        injections.append(inject_peft_and_freeze(method, model))

    def load(model: nn.Module) -> None:
        injection = rank_injection(model, injections)
        reset_adapters(model, stage.seed, ctx.device)
        load_base(base, model, injection, stage.base_mapping, pipeline_stages=ctx.degrees.pp > 1)

    trainer_config = stage.trainer_config(config.checkpoints, trainable_only=True)  # the base is loaded first
    built: list[BuiltModel] = []

    def model_provider(ctx: DistributedContext, loader: ModelLoader | None) -> BuiltModel:
        microbatches = trainer_config.microbatches_per_step(data_parallel_size(ctx))
        injections.clear()
        built.append(
            build_rank_model(
                stage, config.model, ctx, microbatches_per_step=microbatches, prepare=prepare, loader=loader
            )
        )
        return built[-1]

    task = packed_task(stage, config.model)

    tracker = build_tracker(
        config.tracker, enabled=ctx.is_main_process, hparams=config.model_dump(mode="json"), name="finetune"
    )
    trainer = build_stage_trainer(
        ctx,
        stage,
        checkpoints=config.checkpoints,
        train_shards=config.train_shards,
        seq_len=config.seq_len,
        model_provider=model_provider,
        task=task,
        loader=load,
        tracker=tracker,
        events=events,
        trainable_only=True,  # the base is loaded; only adapters are new
    )
    model = trainer.parts.model
    trainable, total = parameter_counts(model, ctx)
    before = validation_loss(config, ctx, built[-1], task)
    result = trainer.train()
    tracker.close()
    after = validation_loss(config, ctx, built[-1], task)
    if not result.preempted:
        export_outputs(config, ctx, model, method, rank_injection(model, injections))
    finetune = FinetuneResult(
        train=result,
        base=base,
        validation_loss_before=before,
        validation_loss_after=after,
        trainable_parameters=trainable,
        total_parameters=total,
    )
    if ctx.is_main_process and not result.preempted:
        report = {key: value for key, value in asdict(finetune).items() if key != "train"}
        report |= {"base": str(base), "last_step": result.last_step}
        (config.output / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return finetune


def _train(config: FinetuneRankConfig, ctx: DistributedContext, events: EventBus) -> str:
    result = run_finetune(config, ctx, events)
    return (
        f"finetune finished at step {result.train.last_step}: validation loss {result.validation_loss_before} -> "
        f"{result.validation_loss_after}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    return training_rank_main(
        argv,
        "finetune",
        __doc__,
        lambda path, overrides: load_config(FinetuneRankConfig, path, overrides),  # the one validation on a rank
        _train,
    )


if __name__ == "__main__":
    raise SystemExit(main())
